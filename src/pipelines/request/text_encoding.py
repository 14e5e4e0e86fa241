"""UMT5 prompt encoding as Wan pipelines do it (shared by the pipeline and training), and the prompt checks.

Tokens past each prompt's length are zeroed, then every prompt is padded to `max_sequence_length`, so
a prompt's embedding does not depend on what else is in the batch.

A prompt is checked before any work (`check_prompts`): a tokenizer silently maps words it does not know to
`<unk>` and cuts long prompts at `max_sequence_length`, which turns "A Red Circle." into a video of nothing in
particular. Unknown words and truncation are reported as a `PromptWarning` naming the words; a prompt with no
word the tokenizer knows is refused. Word-level tokenizers (the embedded models') normalise case, accents and
punctuation themselves (`normalize_word_level`).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, normalizers, pre_tokenizers

from ...checks import check_int

# UMT5 was trained at 512 tokens; the encoder's attention grows with the square of the length, so lengths far
# past this are refused rather than allocated (10**6 tokens would ask for terabytes).
MAX_SEQUENCE_LENGTH_LIMIT = 4096
# A vocabulary this small is listed in the "no known word" error, so the user sees what the model understands.
_LISTED_VOCABULARY_SIZE = 64


# A fast tokenizer keeps its padding and truncation settings in its shared Rust object and changes them on every
# call, so concurrent streams calling it with different settings (the check without padding, the encoding with)
# could get another call's padding: a prompt embedded at another length, a silently different video.
_TOKENIZER_LOCK = threading.Lock()


class PromptWarning(UserWarning):
    """A prompt the tokenizer reads only in part: unknown words are ignored, or the end is cut off."""


def normalize_word_level(backend: Tokenizer) -> Tokenizer:
    """Make a word-level `tokenizers.Tokenizer` read "A Red Circle, moving left." as "a red circle moving left":
    Unicode-decompose and strip accents, lowercase, split on whitespace and drop punctuation."""
    backend.normalizer = normalizers.Sequence(
        [normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()]
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="removed")]
    )
    return backend


def check_max_sequence_length(value) -> int:
    """`max_sequence_length` as an int in [1, MAX_SEQUENCE_LENGTH_LIMIT]; raises ValueError naming it otherwise."""
    return check_int("max_sequence_length", value, 1, MAX_SEQUENCE_LENGTH_LIMIT, hint="UMT5 uses 512")


def _known_words_hint(tokenizer) -> str:
    vocabulary = tokenizer.get_vocab()
    if len(vocabulary) > _LISTED_VOCABULARY_SIZE:
        return ""
    special = set(tokenizer.all_special_tokens)
    words = sorted(word for word in vocabulary if word not in special)
    return f" This model's tokenizer knows only these words: {', '.join(words)}."


def check_prompts(
    tokenizer, prompts: Sequence[str], max_sequence_length: int, name: str = "prompt", require_known_word: bool = True
) -> list[str]:
    """Report what the tokenizer will not read in each prompt; returns the warnings it issued.

    Args:
        prompts: the texts, as given (the tokenizer's own normaliser applies).
        max_sequence_length: tokens kept per prompt, special tokens included.
        name: the argument named in messages (`prompt`, `prompt_schedule`, `negative_prompt`).
        require_known_word: refuse a prompt none of whose words the tokenizer knows (not for negative prompts,
            which may be empty).

    Raises:
        ValueError: a prompt with no known word, when `require_known_word`.
    """
    unknown_id = tokenizer.unk_token_id
    special_ids = set(tokenizer.all_special_ids) - {unknown_id}
    reserved = tokenizer.num_special_tokens_to_add()
    messages = []
    for text in prompts:
        with _TOKENIZER_LOCK:
            encoding = tokenizer(
                text, add_special_tokens=False, truncation=False, return_offsets_mapping=tokenizer.is_fast
            )
        ids = encoding.input_ids  # content tokens only
        offsets = encoding.get("offset_mapping") or [None] * len(ids)
        pieces = [text[s:e] if span is not None and (s := span[0]) < (e := span[1]) else None for span in offsets]
        unknown = [piece or tokenizer.unk_token for token, piece in zip(ids, pieces) if token == unknown_id]
        known = [token for token in ids if token != unknown_id and token not in special_ids]
        if require_known_word and not known:
            raise ValueError(
                f"`{name}` {text!r} has no word the tokenizer knows"
                + (f" (unknown: {', '.join(map(repr, unknown))})" if unknown else "")
                + "; it would generate a video of nothing in particular."
                + _known_words_hint(tokenizer)
            )
        if unknown:
            messages.append(
                f"`{name}` {text!r}: {len(unknown)} word(s) unknown to the tokenizer are ignored: "
                f"{', '.join(map(repr, unknown))}."
            )
        kept = max_sequence_length - reserved
        if len(ids) > kept:
            dropped = text[offsets[kept][0] :] if offsets[kept] is not None else f"token {kept} on"
            messages.append(
                f"`{name}` {text!r} is {len(ids) + reserved} tokens; only the first {max_sequence_length} "
                f"(`max_sequence_length`) are used, so {dropped!r} is ignored."
            )
    for message in messages:
        warnings.warn(message, PromptWarning, stacklevel=3)
    return messages


@torch.no_grad()
def encode_prompts(
    tokenizer, text_encoder, prompts: list[str], max_sequence_length: int, device=None, dtype=None
) -> torch.Tensor:
    """`(len(prompts), max_sequence_length, text_dim)` embeddings, zero past each prompt's end."""
    device = device or text_encoder.device
    with _TOKENIZER_LOCK:
        inputs = tokenizer(
            prompts,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
    ids, mask = inputs.input_ids.to(device), inputs.attention_mask.to(device)
    hidden = text_encoder(ids, mask).last_hidden_state
    hidden = hidden * mask.unsqueeze(-1).to(hidden.dtype)
    return hidden.to(dtype=dtype or hidden.dtype)
