"""Measured thresholds: `CompressionConfig(link=...)` compresses only where the GPU
benchmark found compression to pay, and what the repo states is in sync with the results."""
import pytest

from benchmarks import report
from taco_jax import CompressionConfig, _measured

MIB = 1 << 20


def test_without_link_min_bytes_decides():
  cfg = CompressionConfig(min_bytes=MIB)
  assert not cfg.pays_for("reduce_scatter", MIB - 1)
  assert cfg.pays_for("reduce_scatter", MIB)
  assert CompressionConfig().pays_for("all_reduce", 1)


@pytest.mark.parametrize("link", sorted(_measured.MIN_BYTES))
@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter", "all_reduce"])
def test_link_applies_the_measured_size(link, collective):
  cfg = CompressionConfig(link=link)
  threshold = _measured.MIN_BYTES[link][collective]
  if threshold is None:  # never paid on this link: always the plain collective
    assert not any(cfg.pays_for(collective, 1 << k) for k in range(40))
  else:
    assert not cfg.pays_for(collective, threshold - 1)
    assert cfg.pays_for(collective, threshold)


def test_unmeasured_collective_falls_back_to_min_bytes():
  cfg = CompressionConfig(link="nvlink", min_bytes=10)
  assert cfg.pays_for("ppermute", 10) and not cfg.pays_for("ppermute", 9)


def test_larger_bound_wins():
  link = next(iter(_measured.MIN_BYTES))
  measured = _measured.MIN_BYTES[link]["all_gather"] or 0
  cfg = CompressionConfig(link=link, min_bytes=measured + MIB)
  assert not cfg.pays_for("all_gather", measured + MIB - 1)


def test_unknown_link_is_a_clear_error():
  with pytest.raises(ValueError, match="link must be None or one of"):
    CompressionConfig(link="infiniband")


def test_readme_and_thresholds_are_generated_from_the_results():
  assert report.main(["--check"]) == 0, "run python -m benchmarks.report"
