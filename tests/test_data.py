"""Data: byte tokenizer, embedded corpus determinism and split, batches, bad paths."""
import pathlib

import numpy as np
import pytest

from taco_jax import data

MB = 1_000_000


def test_encode_decode_roundtrip():
  text = 'def f(x):\n  return "é" * x\n'
  toks = data.encode(text)
  assert toks.dtype == np.uint8 and len(toks) == len(text.encode())
  assert data.decode(toks) == text


def test_stdlib_corpus_deterministic_and_cached(tmp_path):
  a = data.stdlib_corpus(tmp_path / 'a', val_fraction=0.1, max_bytes=MB)
  files = sorted((tmp_path / 'a').glob('*.npy'))
  assert len(files) == 2 and all('py3.' in f.name for f in files)  # key has the version
  mtimes = [f.stat().st_mtime_ns for f in files]
  again = data.stdlib_corpus(tmp_path / 'a', val_fraction=0.1, max_bytes=MB)
  assert [f.stat().st_mtime_ns for f in files] == mtimes  # served from the cache
  b = data.stdlib_corpus(tmp_path / 'b', val_fraction=0.1, max_bytes=MB)  # rebuilt
  for c in (again, b):
    np.testing.assert_array_equal(a.train, c.train)
    np.testing.assert_array_equal(a.val, c.val)
  assert a.train.dtype == np.uint8 and len(a.val) > 0
  assert len(a.train) + len(a.val) <= MB + 2 * 2000  # cap (+ file separators)


def test_stdlib_split_is_by_file_and_disjoint():
  files = data.stdlib_files()
  rels = [r for r, _ in files]
  assert rels == sorted(rels) and not any('site-packages' in r for r in rels)
  val = {r for r in rels if data.is_val_file(r, 0.05)}
  train = set(rels) - val
  assert val and train and not val & train
  assert 0.01 < len(val) / len(rels) < 0.15
  assert val == {r for r in rels if data.is_val_file(r, 0.05)}  # stable


def test_batches_are_a_function_of_seed_and_step():
  tokens = np.arange(1000, dtype=np.uint16) % 256
  kw = dict(seed=3, batch_size=4, seq_len=16)
  b0 = data.batch_at(tokens, 5, **kw)
  assert b0.shape == (4, 17) and b0.dtype == np.int32
  np.testing.assert_array_equal(b0, data.batch_at(tokens, 5, **kw))
  assert not np.array_equal(b0, data.batch_at(tokens, 6, **kw))
  assert not np.array_equal(b0, data.batch_at(tokens, 5, **{**kw, 'seed': 4}))
  assert not np.array_equal(b0, data.batch_at(tokens, 5, stream=1, **kw))
  assert np.all(np.diff(b0.astype(int), axis=1) % 256 == 1)  # contiguous windows


def test_user_paths(tmp_path):
  f = tmp_path / 'a.txt'
  f.write_text('hello world\n' * 100)
  c = data.load_corpus(str(f), cache_dir=tmp_path, val_fraction=0.1)
  assert len(c.val) == 120 and len(c.train) == 1080
  d = tmp_path / 'dir'
  d.mkdir()
  for i in range(40):
    (d / f'{i:02d}.txt').write_text(f'file {i}\n' * 10)
  (d / '.hidden').write_text('x')
  c = data.load_corpus(str(d), cache_dir=tmp_path, val_fraction=0.2)
  expected = sum(len(f'file {i}\n') * 10 + 2 for i in range(40))  # + separators, no .hidden
  assert len(c.train) > 0 and len(c.val) > 0 and len(c.train) + len(c.val) == expected
  (d / 'sub').mkdir()
  (d / 'sub' / 'm.py').write_text('import os\n')
  (d / 'sub' / 'm.so').write_bytes(bytes(range(256)))
  c = data.load_corpus(str(d), cache_dir=tmp_path, include='*.py')  # only the .py, recursively
  assert data.decode(np.concatenate([c.train, c.val])) == 'import os\n\n\n'
  with pytest.raises(ValueError, match=r"no \(non-hidden\) files matching '\*.md'"):
    data.load_corpus(str(d), cache_dir=tmp_path, include='*.md')
  np.save(tmp_path / 't.npy', np.arange(1000, dtype=np.uint16))
  c = data.load_corpus(str(tmp_path / 't.npy'), cache_dir=tmp_path, val_fraction=0.1)
  assert c.train.dtype == np.uint16 and c.val[-1] == 999
  with pytest.raises(ValueError, match='vocab_size'):
    data.check_corpus(c, seq_len=8, vocab_size=256)
  np.arange(500, dtype=np.uint8).tofile(tmp_path / 't.bin')
  c = data.load_corpus(str(tmp_path / 't.bin'), cache_dir=tmp_path, bin_dtype='uint8')
  assert c.train.dtype == np.uint8 and len(c.train) + len(c.val) == 500
  with pytest.raises(ValueError, match='seq_len'):
    data.check_corpus(c, seq_len=100, vocab_size=256)


def test_bad_paths(tmp_path, monkeypatch):
  missing = tmp_path / 'nope.txt'
  with pytest.raises(FileNotFoundError, match='nope.txt'):
    data.load_corpus(str(missing), cache_dir=tmp_path)
  (tmp_path / 'empty.txt').write_bytes(b'')
  with pytest.raises(ValueError, match='empty.txt.*empty'):
    data.load_corpus(str(tmp_path / 'empty.txt'), cache_dir=tmp_path)
  (tmp_path / 'emptydir').mkdir()
  with pytest.raises(ValueError, match='emptydir'):
    data.load_corpus(str(tmp_path / 'emptydir'), cache_dir=tmp_path)
  (tmp_path / 'junk.npy').write_bytes(b'not a numpy file')
  with pytest.raises(ValueError, match='junk.npy'):
    data.load_corpus(str(tmp_path / 'junk.npy'), cache_dir=tmp_path)
  locked = tmp_path / 'locked.txt'
  locked.write_text('secret')

  def deny(self):
    raise PermissionError(13, 'Permission denied', str(self))

  monkeypatch.setattr(pathlib.Path, 'read_bytes', deny)  # chmod does not stop root
  with pytest.raises(PermissionError, match='locked.txt.*not readable'):
    data.load_corpus(str(locked), cache_dir=tmp_path)
