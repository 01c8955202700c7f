"""The demo's data: the Python standard library's own sources, a BPE tokenizer trained on them, batches.

Real text that every machine with Python has offline: the ``.py`` files under
``sysconfig.get_paths()["stdlib"]`` in sorted relative-path order (test packages and installed
third-party packages left out), taken whole until a fixed byte budget is reached (the last file cut
at the budget). A byte-level BPE tokenizer (``tokenizers``) is trained on that text and cached, with
the token stream, under a cache directory keyed by everything that changes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

#: directory names never read: installed packages and the stdlib's test suites (which hold
#: deliberately broken or oddly encoded files)
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})

#: separates files in the token stream
EOS = "<|endoftext|>"

#: bump when the corpus, tokenizer or token-stream format changes (invalidates caches)
_FORMAT = 1


@dataclass(frozen=True)
class Corpus:
    root: str
    files: list[str]  # relative paths, in order
    texts: list[str]  # one per file (the last may be cut at the byte budget)
    n_bytes: int
    sha256: str


def default_cache_dir() -> Path:
    """``$TRUEFUSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/truefuse``, else ``~/.cache/truefuse``."""
    if os.environ.get("TRUEFUSE_CACHE_DIR"):
        return Path(os.environ["TRUEFUSE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "truefuse"


def stdlib_sources(root: str | os.PathLike | None = None) -> list[Path]:
    """The stdlib's ``.py`` files (relative to ``root``), sorted by their POSIX relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        found.extend(rel_dir / f for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.as_posix())


def load_corpus(max_bytes: int, root: str | os.PathLike | None = None) -> Corpus:
    """Whole stdlib files in order until ``max_bytes`` UTF-8 bytes; files that are not valid UTF-8 are skipped."""
    if max_bytes <= 0:
        raise ValueError(f"corpus byte budget must be positive, got {max_bytes}")
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files, texts, total = [], [], 0
    digest = hashlib.sha256()
    for rel in stdlib_sources(root):
        raw = (root / rel).read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not raw.strip():
            continue
        raw = raw[: max_bytes - total]
        text = raw.decode("utf-8", errors="ignore")  # a cut may split a multi-byte character
        files.append(rel.as_posix())
        texts.append(text)
        total += len(raw)
        digest.update(rel.as_posix().encode() + b"\0" + raw + b"\0")
        if total >= max_bytes:
            break
    if not texts:
        raise RuntimeError(f"no Python sources found under {root}")
    return Corpus(str(root), files, texts, total, digest.hexdigest())


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,  # stop when no pair repeats: a large vocab_size gives what the text holds
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


@dataclass
class TokenData:
    tokenizer: object  # tokenizers.Tokenizer
    tokens: torch.Tensor  # int64 stream: file tokens, EOS, file tokens, EOS, ...
    vocab_size: int  # the trained tokenizer's size (<= the asked one)
    eos_id: int
    cached: bool  # loaded from the cache rather than trained here
    key: str
    cache_dir: str


def tokenize_corpus(corpus: Corpus, vocab_size: int, cache_dir: str | os.PathLike | None = None) -> TokenData:
    """Train (or load from the cache) a byte-level BPE tokenizer of at most ``vocab_size`` tokens on
    ``corpus`` and encode it into one token stream. The cache key covers the corpus hash, the vocab
    size, the tokenizers version and this format's version."""
    import tokenizers
    from tokenizers import Tokenizer

    if vocab_size < 257:
        raise ValueError(f"a byte-level BPE needs vocab >= 257 (256 bytes + {EOS}), got {vocab_size}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable home: train in a throw-away folder rather than fail
        if cache_dir is not None:
            raise
        import tempfile

        cache = Path(tempfile.mkdtemp(prefix="truefuse-demo-"))
    settings = {"format": _FORMAT, "corpus": corpus.sha256, "vocab": vocab_size, "tokenizers": tokenizers.__version__}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    tok_path, ids_path = cache / f"demo-bpe-{key}.json", cache / f"demo-tokens-{key}.pt"
    cached = tok_path.exists() and ids_path.exists()
    if cached:
        tok = Tokenizer.from_file(str(tok_path))
        tokens = torch.load(ids_path, weights_only=True)
    else:
        tok = _train_tokenizer(corpus.texts, vocab_size)
        eos = tok.token_to_id(EOS)
        ids: list[int] = []
        for enc in tok.encode_batch(corpus.texts):
            ids.extend(enc.ids)
            ids.append(eos)
        tokens = torch.tensor(ids, dtype=torch.int64)
        _atomic_write(tok_path, lambda p: tok.save(str(p)))
        _atomic_write(ids_path, lambda p: torch.save(tokens, p))
        _atomic_write(cache / f"demo-bpe-{key}.settings.json", lambda p: p.write_text(json.dumps(settings, indent=1)))
    return TokenData(tok, tokens, tok.get_vocab_size(), tok.token_to_id(EOS), cached, key, str(cache))


def make_batches(tokens: torch.Tensor, steps: int, batch: int, seq: int, seed: int) -> torch.Tensor:
    """``(steps, batch, seq)`` int64: non-overlapping windows of the stream in an order drawn from
    ``seed``; windows are reused (a new permutation per pass) only when the stream runs out."""
    n_windows = tokens.numel() // seq
    if n_windows < 1:
        raise ValueError(f"the token stream ({tokens.numel()} tokens) is shorter than one sequence of {seq}")
    windows = tokens[: n_windows * seq].view(n_windows, seq)
    gen = torch.Generator().manual_seed(seed)
    need = steps * batch
    order = torch.cat([torch.randperm(n_windows, generator=gen) for _ in range(-(-need // n_windows))])[:need]
    return windows[order].view(steps, batch, seq).clone()


def describe(corpus: Corpus, data: TokenData) -> dict:
    """The data's facts for the results file."""
    return {
        "source": "Python standard library .py sources",
        "python": sys.version.split()[0],
        "root": corpus.root,
        "files": len(corpus.files),
        "first_file": corpus.files[0],
        "last_file": corpus.files[-1],
        "bytes": corpus.n_bytes,
        "sha256": corpus.sha256,
        "tokens": int(data.tokens.numel()),
        "tokenizer_vocab": data.vocab_size,
        "tokenizer_cached": data.cached,
        "tokenizer_key": data.key,
        "cache_dir": data.cache_dir,
    }
