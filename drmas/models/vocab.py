"""Tokenizers of the builtin models: one token per character, or whole words of a team's
transcripts.

Both are byte-level BPE in exactly the pipeline transformers 5 builds for any qwen2 folder
(Qwen2Tokenizer: NFC, the Qwen2 pre-tokenizer split, byte-level symbols), so the ids a
learner, the hf engine and vLLM compute from the saved folder are the ids the warm start
trained on; `check_loaded` fails the build if a transformers version ever changes that.

- `char`: no merges; one token per character of ALPHABET. The math team's default: its
  Solver copies and computes digits.
- `words`: BPE merges learned from the team's own transcripts (TranscriptSource.
  tokenizer_corpus), so every word the team writes, names included, is one token (with
  its leading space: " Taki"). Copying a name from the question or a retrieved passage
  into an action is then copying one or two tokens instead of eight characters, which the
  tiny model learns in a fraction of the steps (the search team). Any other text still
  encodes, character by character.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from tokenizers.models import Model
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
"""Ids 0, 1, 2."""
ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
"""Printable ASCII (space, digits, letters, punctuation) and newline: one token each."""
MAX_LENGTH = 512
"""model_max_length written with the tokenizer (the builtins' max_position_embeddings)."""


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of ALPHABET; decoding concatenates (spaces preserved)."""
    from tokenizers import models

    symbols = _byte_symbols()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({symbols[ord(char)]: len(SPECIAL_TOKENS) + i for i, char in enumerate(ALPHABET)})
    return _fast(_pipeline(models.BPE(vocab=vocab, merges=[], unk_token=None, byte_fallback=False)))


def word_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """ALPHABET's characters plus up to `vocab_size` tokens in all, merged by BPE from
    `corpus` (words seen at least twice). Deterministic for the same corpus."""
    from tokenizers import models, trainers

    symbols = _byte_symbols()
    core = _pipeline(models.BPE(unk_token=None, byte_fallback=False))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=[symbols[ord(char)] for char in ALPHABET],
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer)
    return _fast(core)


def _pipeline(model: Model) -> Tokenizer:
    """A tokenizers.Tokenizer with Qwen2Tokenizer's normalizer, pre-tokenizer and decoder."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    core = Tokenizer(model)
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    return core


def _fast(core: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around `core`, with our special tokens and left padding."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=MAX_LENGTH,
    )


def _byte_symbols() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2): space is "Ġ",
    newline "Ċ"."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    import json

    tokenizer.save_pretrained(folder)
    # Name the class that every transformers version resolves for a qwen2 folder and keep
    # the classic special_tokens_map.json next to it.
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config.pop("backend", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    special = {"pad_token": "<pad>", "eos_token": "<eos>", "unk_token": "<unk>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def check_loaded(
    loaded: PreTrainedTokenizerBase, written: PreTrainedTokenizerFast, sample: str, kind: str
) -> None:
    """Fail the build (not the RL run hours later) unless the tokenizer a consumer loads
    from the folder gives the written tokenizer's ids with an exact round trip (and, for
    `char`, one id per character)."""
    ids = loaded(sample, add_special_tokens=False).input_ids
    back = loaded.decode([*ids, loaded.eos_token_id], skip_special_tokens=True)
    same = ids == written(sample, add_special_tokens=False).input_ids
    per_char = kind != "char" or len(ids) == len(sample)
    if not (same and per_char and back == sample):
        raise RuntimeError(
            f"{type(loaded).__name__} loaded from the builtin folder does not match the "
            f"{kind} tokenizer it was written with ({len(ids)} ids for {len(sample)} "
            f"characters, same ids {same}, round trip {back == sample}); this transformers "
            "version changed how tokenizers load"
        )
