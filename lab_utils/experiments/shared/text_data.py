"""Character-level text for the GPT: the corpus, its vocabulary, splits and batches.

Where the text comes from (``corpus=``, or ``$LAB_CORPUS``):

- ``"shakespeare"``: tiny-Shakespeare (Karpathy's char-rnn ``input.txt``, 1,115,394
  bytes, SHA-256 checked) from ``data/tinyshakespeare.txt``, put there by
  ``python -m lab_utils prepare`` (:func:`prepare_corpus`) on a machine with internet;
- ``"stdlib"``: an offline stand-in that exists wherever Python does: the standard library's
  top-level modules (sorted by name, up to :data:`STDLIB_CHARS` characters, non-ASCII as ``?``),
  deterministic for the Python version its name records (``python-stdlib-3.12.3``);
- ``"auto"`` (default): Shakespeare when prepared, else the stand-in with a warning.

Records built from the stand-in are marked ``synthetic=True`` (tables then say *stand-in*).

The first 90 % of the text trains, the rest validates. A training example is a window of
``block_size + 1`` consecutive tokens: the input its first ``block_size``, the target the
same shifted by one. :class:`TokenWindows` starts one every ``stride`` tokens, so an epoch
is ``(len - block_size - 1) // stride + 1`` windows.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
import urllib.request
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils.data import Dataset

from lab_utils.engine import config
from lab_utils.engine.config import CORPUS_CHOICES
from lab_utils.learn.errors import LabError, check_choice

CORPUS_ENV = "LAB_CORPUS"
SHAKESPEARE_FILE = "tinyshakespeare.txt"
SHAKESPEARE_BYTES = 1_115_394
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_URLS = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
    "https://storage.googleapis.com/download.tensorflow.org/data/shakespeare.txt",
)
#: Characters of the offline stand-in: about the size of tiny-Shakespeare.
STDLIB_CHARS = 1_100_000
TRAIN_FRACTION = 0.9


@dataclass(frozen=True)
class Corpus:
    """A text and where it came from. ``synthetic`` is True for the offline stand-in."""

    name: str
    text: str
    source: str
    synthetic: bool

    def __len__(self) -> int:
        return len(self.text)


# --------------------------------------------------------------------------- prepare


def sha256_of(path: Path) -> str:
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def shakespeare_path(root: Path | None = None) -> Path:
    return (Path(root) if root else config.data_dir()) / SHAKESPEARE_FILE


def shakespeare_present(root: Path | None = None) -> bool:
    """True when the prepared file exists with the expected size (the hash is checked on load)."""
    p = shakespeare_path(root)
    return p.exists() and p.stat().st_size == SHAKESPEARE_BYTES


def prepare_corpus(root: Path | None = None, timeout_s: float = 60.0) -> Path:
    """Download tiny-Shakespeare into ``root`` (default ``data/``) from the first mirror that gives
    the right SHA-256, unless a verified copy is there; :class:`LabError` naming the fix if none."""
    dest = shakespeare_path(root)
    if dest.exists() and sha256_of(dest) == SHAKESPEARE_SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for url in SHAKESPEARE_URLS:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 (fixed https URLs)
                payload = r.read()
        except Exception as e:  # URLError, timeouts, ...: try the next mirror
            errors.append(f"{url}: {e.__class__.__name__}: {e}")
            continue
        digest = hashlib.sha256(payload).hexdigest()
        if digest != SHAKESPEARE_SHA256:
            errors.append(f"{url}: SHA-256 {digest[:12]}... is not the expected {SHAKESPEARE_SHA256[:12]}...")
            continue
        tmp = dest.with_name(dest.name + ".tmp")
        tmp.write_bytes(payload)
        os.replace(tmp, dest)
        return dest
    raise LabError(f"Could not download tiny-Shakespeare into {dest} ({'; '.join(errors)}); run "
                   "`python -m lab_utils prepare` on a machine with internet (e.g. a login node), or copy "
                   f"char-rnn's input.txt to {dest} by hand (until then the lab uses the stdlib stand-in).")


# --------------------------------------------------------------------------- corpora


def stdlib_corpus(max_chars: int = STDLIB_CHARS) -> Corpus:
    """Source of the standard library's top-level ``*.py`` files, sorted by name, as ASCII."""
    if max_chars <= 0:
        raise LabError(f"max_chars must be positive, got {max_chars!r}.")
    libdir = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in libdir.glob("*.py") if p.is_file())
    parts: list[str] = []
    total = 0
    for p in files:
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        text = "".join(ch if (ch == "\n" or " " <= ch <= "~") else "?" for ch in text.replace("\t", "    "))
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    if total == 0:
        raise LabError(f"No Python standard-library sources found in {libdir}; run "
                       "`python -m lab_utils prepare` with internet to use tiny-Shakespeare instead.")
    version = ".".join(map(str, sys.version_info[:3]))
    return Corpus(name=f"python-stdlib-{version}", text="".join(parts)[:max_chars],
                  source=f"{libdir} (top-level *.py, sorted)", synthetic=True)


def shakespeare_corpus(root: Path | None = None) -> Corpus:
    p = shakespeare_path(root)
    if not p.exists():
        raise LabError(f"tiny-Shakespeare is not at {p}; run `python -m lab_utils prepare` on a machine "
                       "with internet first, or use corpus='stdlib'.")
    if sha256_of(p) != SHAKESPEARE_SHA256:
        raise LabError(f"{p} does not have tiny-Shakespeare's SHA-256; delete it and run "
                       "`python -m lab_utils prepare` again.")
    return Corpus(name="tiny-shakespeare", text=p.read_text(encoding="utf-8"), source=str(p), synthetic=False)


_warned_stand_in = False


def resolve_corpus(corpus: str | None = None, root: Path | None = None) -> str:
    """``"shakespeare"`` or ``"stdlib"``: what ``corpus`` (or ``$LAB_CORPUS``) means here. Asked for
    tiny-Shakespeare where it was not prepared: one sentence naming the fix (before any training)."""
    choice = corpus or os.environ.get(CORPUS_ENV) or "auto"
    check_choice(choice, CORPUS_CHOICES, "corpus")
    if choice == "shakespeare" and not shakespeare_present(root):
        asked = "corpus='shakespeare'" if corpus else f"{CORPUS_ENV}=shakespeare"
        raise LabError(f"tiny-Shakespeare is not in {root or config.data_dir()} ({asked}) and compute "
                       "nodes cannot download it; run `make prepare` (or `python -m lab_utils prepare`) on a "
                       "machine with internet first, or use the offline stand-in (corpus='stdlib', or "
                       "LAB_CORPUS=stdlib).")
    if choice == "auto":
        return "shakespeare" if shakespeare_present(root) else "stdlib"
    return choice


def load_corpus(corpus: str | None = None, root: Path | None = None, max_chars: int | None = None) -> Corpus:
    """The text to train on (see the module docstring); ``max_chars`` keeps a prefix."""
    global _warned_stand_in
    kind = resolve_corpus(corpus, root)
    if kind == "shakespeare":
        c = shakespeare_corpus(root)
    else:
        if (corpus or os.environ.get(CORPUS_ENV) or "auto") == "auto" and not _warned_stand_in:
            warnings.warn("tiny-Shakespeare is not in data/: using Python standard-library source as an "
                          "offline stand-in (run `python -m lab_utils prepare` with internet for the real "
                          "corpus).", stacklevel=2)
            _warned_stand_in = True
        c = stdlib_corpus(max_chars or STDLIB_CHARS)
    if max_chars is not None:
        if max_chars <= 0:
            raise LabError(f"max_chars must be positive, got {max_chars!r}.")
        c = replace(c, text=c.text[:max_chars])
    return c


# --------------------------------------------------------------------------- vocabulary


@dataclass(frozen=True)
class CharVocab:
    """Characters in id order; id ``i`` is ``chars[i]``."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        return cls("".join(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    @property
    def size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Token ids (int64) of ``text``; an unknown character raises :class:`LabError`."""
        index = {ch: i for i, ch in enumerate(self.chars)}
        try:
            return torch.tensor([index[ch] for ch in text], dtype=torch.long)
        except KeyError as e:
            raise LabError(f"Character {e.args[0]!r} is not in the vocabulary; use text made of "
                           "the training corpus's characters.") from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


# --------------------------------------------------------------------------- splits, windows


@dataclass
class TextSplits:
    """Encoded train/val token tensors (int64), the vocabulary and the corpus's identity."""

    train: torch.Tensor
    val: torch.Tensor
    vocab: CharVocab
    corpus_name: str
    synthetic: bool

    @property
    def train_tokens(self) -> int:
        return int(self.train.numel())

    @property
    def val_tokens(self) -> int:
        return int(self.val.numel())


def split_corpus(corpus: Corpus, train_fraction: float = TRAIN_FRACTION) -> TextSplits:
    """Encode the whole text and split it by position: first ``train_fraction`` trains."""
    if not 0.0 < train_fraction < 1.0:
        raise LabError(f"train_fraction must be between 0 and 1, got {train_fraction!r}.")
    vocab = CharVocab.from_text(corpus.text)
    ids = vocab.encode(corpus.text)
    n = int(train_fraction * len(ids))
    return TextSplits(train=ids[:n], val=ids[n:], vocab=vocab, corpus_name=corpus.name,
                      synthetic=corpus.synthetic)


def load_splits(corpus: str | None = None, root: Path | None = None,
                max_chars: int | None = None) -> TextSplits:
    """:func:`load_corpus` then :func:`split_corpus` (90/10)."""
    return split_corpus(load_corpus(corpus, root, max_chars))


class TokenWindows(Dataset):
    """Windows of ``block_size + 1`` tokens starting every ``stride`` tokens: item ``i`` is
    ``(data[s : s + block_size], data[s + 1 : s + block_size + 1])``, ``s = i * stride``."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int | None = None):
        config.check_positive_int(block_size, "block_size")
        self.stride = config.check_positive_int(stride if stride is not None else block_size, "stride")
        if data.numel() < block_size + 1:
            raise LabError(f"The text has {data.numel()} tokens, fewer than block_size + 1 = "
                           f"{block_size + 1}; use a longer corpus (more max_chars) or a smaller block_size.")
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.data.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = i * self.stride
        w = self.data[s: s + self.block_size + 1]
        return w[:-1], w[1:]
