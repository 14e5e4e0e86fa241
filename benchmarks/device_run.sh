#!/usr/bin/env bash
# The standing GPU order as one prepared script, for a lent device machine (15 minutes of device time a session,
# the machine's start included): gpu_fps.py (the rows docs/gpu/ has no number for first), then gpu_checks.py, each
# under its own time limit, every table written to $OUT (or ./gpu-out) as docs/gpu/ files are, command line first.
#
# The device machine reaches no registry, so torchao (fp8 rows) comes as wheels downloaded here into ./wheels
# (git-ignored) and carried with the run:
#     for v in 0.18.0 0.17.0 0.16.0; do pip download "torchao==$v" --no-deps -d wheels; done  # one version a call
#     (the newest that imports with the machine's torch wins; ~3 MB each)
#     run(command="bash benchmarks/device_run.sh", carry=["wheels"], timeout_s=600)
# FPS_BUDGET_S and CHECKS_S override the two limits (defaults 380 s and 150 s).
#
# Steps are named on the command line; the default is the standing order, "fps checks". "serve" is issue 40's
# batched-server row (serve_load.py at Wan 2.1 1.3B's shape, the batched server only, SERVE_S limit, default 240 s):
# a second call on the still-warm machine once the first has left device time, e.g.
#     run(command="bash benchmarks/device_run.sh serve", timeout_s=300)
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS="${*:-fps checks}"
for name in $STEPS; do  # every step checked before any work
    case "$name" in
    fps | checks | serve) ;;
    *) echo "device_run.sh: unknown step '$name': give fps, checks or serve (default: fps checks)" >&2 && exit 2 ;;
    esac
done
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
FPS_BUDGET_S="${FPS_BUDGET_S:-380}"
CHECKS_S="${CHECKS_S:-150}"
# rolldiff from this tree without installing it (the package root is src/): a link named rolldiff on the path.
SITE="$(mktemp -d)"
trap 'rm -rf "$SITE"' EXIT
ln -s "$PWD/src" "$SITE/rolldiff"
export PYTHONPATH="$SITE:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"
: >"$OUT/install.log"
# torchao from the carried wheels into that folder only (nothing installed into the machine's environment),
# newest first, kept only if it imports with the machine's torch.
for wheel in $(ls -r wheels/torchao-*.whl 2>/dev/null); do
    python -m pip install -q --no-deps --no-index --target "$SITE" "$wheel" >>"$OUT/install.log" 2>&1 &&
        python -c "import torchao.quantization" >>"$OUT/install.log" 2>&1 && { echo "torchao: $wheel"; break; }
    rm -rf "$SITE"/torchao "$SITE"/torchao-*
done

header() {
    python - "$@" <<'PY'
import sys, subprocess, torch, diffusers, transformers
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
try:
    import torchao; ao = f", torchao {torchao.__version__}"
except ImportError:
    ao = ", torchao not installed"
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print("$ python " + " ".join(sys.argv[1:]))
print(f"Recorded on one {gpu}, torch {torch.__version__}, diffusers {diffusers.__version__}, "
      f"transformers {transformers.__version__}{ao}, rolldiff {commit or 'working tree'}.\n")
PY
}

run_timed() {  # run_timed SECONDS FILE SCRIPT ARGS...: the script's output under its header, cut at SECONDS
    local seconds=$1 file=$2
    shift 2
    { header "$@"; timeout --signal=INT --kill-after=20 "$seconds" python "$@" 2>&1; echo "exit status: $?"; } | tee "$OUT/$file"
}

SERVE_S="${SERVE_S:-240}"
for name in $STEPS; do
    case "$name" in
    fps) run_timed $((FPS_BUDGET_S + 90)) gpu_fps.txt benchmarks/gpu_fps.py --no-baseline --budget-s "$FPS_BUDGET_S" ;;
    checks) run_timed "$CHECKS_S" gpu_checks.txt benchmarks/gpu_checks.py --seconds 3 ;;
    serve) run_timed "$SERVE_S" serve_load.txt benchmarks/serve_load.py --wan-1-3b-shape --frames 48 --servers batched ;;
    esac
done
