"""Byte-level tokenizer, the embedded default corpus, and deterministic batches.

Tokens are bytes (vocab 256). The default corpus is the running interpreter's standard
library (*.py under `sysconfig.get_paths()["stdlib"]`, site-packages excluded), files in
sorted relative-path order, split into train/validation by a hash of the relative path,
capped at `max_corpus_bytes`, and cached as uint8 .npy files whose name carries the
Python version. A user corpus is a text file, a directory of text files, or a .npy/.bin
token array (uint8/uint16). Batch `step` is a pure function of (seed, step), so a resumed
run sees exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sys
import sysconfig

import numpy as np

VOCAB_SIZE = 256
_SEPARATOR = b'\n\n'


def encode(text: str | bytes) -> np.ndarray:
  """Text (UTF-8) or bytes -> uint8 token array."""
  data = text.encode('utf-8') if isinstance(text, str) else text
  return np.frombuffer(data, dtype=np.uint8).copy()


def decode(tokens) -> str:
  """Token ids (< 256) -> text; invalid UTF-8 becomes U+FFFD."""
  return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode('utf-8', errors='replace')


@dataclasses.dataclass(frozen=True)
class Corpus:
  train: np.ndarray  # 1-D token array (uint8 or uint16)
  val: np.ndarray    # 1-D token array, disjoint source from train
  source: str        # human-readable description of where it came from


def is_val_file(rel_path: str, val_fraction: float) -> bool:
  """Deterministic split by file: a stable hash of the relative path against val_fraction."""
  h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], 'little')
  return h / 2.0**64 < val_fraction


def stdlib_files() -> list[tuple[str, pathlib.Path]]:
  """(relative path, path) of the stdlib's *.py files in sorted order, no site-packages."""
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  out = []
  for p in root.rglob('*.py'):
    rel = p.relative_to(root)
    if any(part in ('site-packages', 'dist-packages') for part in rel.parts) or not p.is_file():
      continue
    out.append((rel.as_posix(), p))
  return sorted(out)


def _join_files(files, val_fraction: float, max_bytes: int | None):
  train, val, total = [], [], 0
  for rel, path in files:
    data = path.read_bytes()
    if max_bytes is not None and total + len(data) > max_bytes:
      break
    total += len(data)
    (val if is_val_file(rel, val_fraction) else train).append(data + _SEPARATOR)
  return encode(b''.join(train)), encode(b''.join(val))


def default_cache_dir() -> pathlib.Path:
  """Where the embedded corpus is cached once per user: $TACO_JAX_CACHE, else
  $XDG_CACHE_HOME/taco_jax, else ~/.cache/taco_jax."""
  if os.environ.get('TACO_JAX_CACHE'):
    return pathlib.Path(os.environ['TACO_JAX_CACHE'])
  base = os.environ.get('XDG_CACHE_HOME') or pathlib.Path.home() / '.cache'
  return pathlib.Path(base) / 'taco_jax'


def stdlib_corpus(cache_dir: str | os.PathLike, *, val_fraction: float,
                  max_bytes: int) -> Corpus:
  """The embedded corpus, built once and cached as .npy under `cache_dir`."""
  v = sys.version_info
  key = f'stdlib-py{v.major}.{v.minor}.{v.micro}-{max_bytes}-{val_fraction:g}'
  cache = pathlib.Path(cache_dir)
  paths = {s: cache / f'corpus-{key}-{s}.npy' for s in ('train', 'val')}
  if not all(p.exists() for p in paths.values()):
    cache.mkdir(parents=True, exist_ok=True)
    train, val = _join_files(stdlib_files(), val_fraction, max_bytes)
    for split, arr in (('train', train), ('val', val)):
      tmp = paths[split].with_suffix(f'.tmp{os.getpid()}.npy')
      np.save(tmp, arr)
      os.replace(tmp, paths[split])  # atomic: concurrent builders never see half a file
  return Corpus(np.load(paths['train']), np.load(paths['val']), f'python stdlib ({key})')


def _split_tail(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
  n_val = max(1, int(len(tokens) * val_fraction))
  return tokens[:-n_val], tokens[-n_val:]


def _load_array(path: pathlib.Path, bin_dtype: str) -> np.ndarray:
  if path.suffix == '.npy':
    arr = np.load(path, mmap_mode='r')
  else:
    if bin_dtype not in ('uint8', 'uint16'):
      raise ValueError(f'data.bin_dtype={bin_dtype!r} for {path}: use uint8 or uint16')
    arr = np.memmap(path, dtype=bin_dtype, mode='r')
  if arr.ndim != 1 or arr.dtype not in (np.uint8, np.uint16):
    raise ValueError(f'token array {path} has dtype {arr.dtype} and shape {arr.shape}; '
                     'expected a 1-D uint8 or uint16 array')
  return arr


def load_corpus(path: str, *, cache_dir: str | os.PathLike, val_fraction: float = 0.05,
                max_corpus_bytes: int = 32_000_000, bin_dtype: str = 'uint16',
                include: str = '*') -> Corpus:
  """The corpus named by `data.path` ('' = embedded stdlib corpus). For a directory, the
  files under it (recursively) whose name matches the glob `include` (e.g. '*.py').

  Raises FileNotFoundError / ValueError naming the path when it is missing, empty,
  unreadable, or yields no validation data.
  """
  if not path:
    return stdlib_corpus(cache_dir, val_fraction=val_fraction, max_bytes=max_corpus_bytes)
  p = pathlib.Path(path).expanduser()
  if not p.exists():
    raise FileNotFoundError(f'data.path {str(p)!r} does not exist; point --config.data.path at '
                            'a text file, a directory of text files, or a .npy/.bin token array '
                            "(or leave it '' for the embedded corpus)")
  try:
    if p.is_dir():
      files = sorted((f.relative_to(p).as_posix(), f) for f in p.rglob(include)
                     if f.is_file() and not any(s.startswith('.') for s in f.relative_to(p).parts))
      if not files:
        raise ValueError(f'data.path {str(p)!r} is a directory with no (non-hidden) files '
                         f'matching {include!r}')
      train, val = _join_files(files, val_fraction, None)
      if len(val) == 0 or len(train) == 0:  # too few files to split by file: split the tail
        train, val = _split_tail(np.concatenate([train, val]), val_fraction)
    elif p.suffix in ('.npy', '.bin'):
      train, val = _split_tail(_load_array(p, bin_dtype), val_fraction)
    else:
      train, val = _split_tail(encode(p.read_bytes()), val_fraction)
  except PermissionError as e:
    raise PermissionError(f'data.path {str(p)!r} is not readable: {e}') from e
  except (OSError, ValueError) as e:  # e.g. a .npy that is not one
    raise ValueError(f'data.path {str(p)!r} could not be read: {e}') from e
  if len(train) + len(val) <= 1:
    raise ValueError(f'data.path {str(p)!r} is empty (no tokens)')
  return Corpus(train, val, str(p))


def check_corpus(corpus: Corpus, *, seq_len: int, vocab_size: int) -> None:
  """Raises ValueError if a split is shorter than one sequence or holds ids >= vocab_size."""
  for name, arr in (('train', corpus.train), ('validation', corpus.val)):
    if len(arr) < seq_len + 1:
      raise ValueError(f'{corpus.source}: the {name} split has {len(arr)} tokens, fewer than '
                       f'data.seq_len + 1 = {seq_len + 1}; use more data or a smaller seq_len')
    top = int(arr.max())
    if top >= vocab_size:
      raise ValueError(f'{corpus.source}: token id {top} >= model.vocab_size={vocab_size}; '
                       f'set --config.model.vocab_size to at least {top + 1}')


def batch_at(tokens: np.ndarray, step: int, *, seed: int, batch_size: int, seq_len: int,
             stream: int = 0) -> np.ndarray:
  """Batch number `step`: [batch_size, seq_len + 1] int32 random windows of `tokens`.

  A pure function of (seed, stream, step); stream 0 = training, 1 = validation.
  """
  rng = np.random.default_rng((seed, stream, step))
  starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
  idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
  return np.asarray(tokens[idx], dtype=np.int32)
