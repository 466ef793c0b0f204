"""`parallel.overlap_grad_reduce`: each layer's gradients all-reduced over "data" inside the
backward pass (`buckets.all_reduce_in_backward`) against reducing them all after it.

A tiny fp32 GPT on 8 CPU devices: the same loss and gradients, one data all-reduce per
layer inside the backward pass, FP8 messages when compressed, and the layouts it refuses.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taco_jax import testing
from taco_jax.codec import CompressionConfig
from taco_jax.plan import CompressionPlan
from taco_jax.testing import hlo
from taco_jax.tp import layout as layout_lib, step as step_lib
from taco_jax.tp.mesh import DATA, make_mesh

CFG = layout_lib.model_config(dict(vocab_size=128, n_layers=3, d_model=32, n_heads=4, d_ff=64,
                                   max_seq_len=16, dtype="float32"))
F32_TOL = 64 * testing.unit_roundoff(jnp.float32)
CODEC = CompressionConfig(format="e4m3", group_size=32)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.cache  # the tests share their programs
def _lowered(layout, overlap, plan=CompressionPlan(), scan_layers=True):
  """(the step lowered, its params, tokens, mesh)."""
  dp, pp, tp = layout
  mesh = make_mesh(dp, pp, tp, jax.devices()[:dp * pp * tp])
  spec = step_lib.ParallelSpec(CFG, dp, pp, tp, 1, plan, scan_layers=scan_layers,
                               overlap_grad_reduce=overlap)
  params = layout_lib.init_params(CFG, mesh, seed=0)
  tokens = jax.device_put(
      jax.random.randint(jax.random.key(1), (8, 17), 0, CFG.vocab_size),
      step_lib.batch_sharding(mesh))
  return (jax.jit(step_lib.loss_and_grads_fn(spec, mesh)).lower(params, tokens), params,
          tokens, mesh)


@functools.cache
def _loss_and_grads(layout, overlap, plan=CompressionPlan(), scan_layers=True):
  """(loss, grads as numpy, the compiled program's collectives over "data") of one step."""
  lowered, params, tokens, mesh = _lowered(layout, overlap, plan, scan_layers)
  exe = lowered.compile(FAST_COMPILE)
  loss, grads = exe(params, tokens)
  over_data = [c for c in hlo.collectives(exe.as_text(), mesh) if c.axes == frozenset({DATA})]
  return float(loss), jax.device_get(grads), over_data


@pytest.mark.parametrize("layout, scan_layers", [((8, 1, 1), False), ((2, 1, 4), True)],
                         ids=["dp8-unrolled", "dp2-tp4-scan"])
def test_same_loss_and_gradients_as_reducing_after_the_backward_pass(layout, scan_layers):
  loss, grads, _ = _loss_and_grads(layout, False, scan_layers=scan_layers)
  loss_o, grads_o, _ = _loss_and_grads(layout, True, scan_layers=scan_layers)
  np.testing.assert_allclose(loss_o, loss, rtol=F32_TOL)
  for (path, g), g_o in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(grads_o)):
    scale = float(np.max(np.abs(g))) or 1.0
    np.testing.assert_allclose(g_o, g, atol=F32_TOL * scale, err_msg=str(path))


def _traced_all_reduces(overlap) -> tuple[int, int]:
  """(all-reduces, matmuls after the first of them) of the unrolled dp=8 step as traced,
  before XLA combines and schedules its collectives."""
  lines = _lowered((8, 1, 1), overlap, scan_layers=False)[0].as_text(dialect="hlo").splitlines()
  reduces = [i for i, line in enumerate(lines) if " all-reduce(" in line]
  return len(reduces), sum(" dot(" in line for line in lines[reduces[0]:])


def test_each_layers_gradients_are_reduced_inside_the_backward_pass():
  """Unrolled, each layer's gradients are all-reduced between the backward matmuls of the
  layers after it and those before it; reducing after the backward pass, no matmul follows
  the first all-reduce. Both send every gradient element once."""
  after, inside = _traced_all_reduces(False), _traced_all_reduces(True)
  assert after[1] == 0 and inside[1] > 0
  assert inside[0] > after[0]  # the layers' own leaves, not the stacked ones
  sent = [sum(c.elements for c in _loss_and_grads((8, 1, 1), overlap, scan_layers=False)[2]
              if c.kind == "all-reduce") for overlap in (False, True)]
  assert sent[0] == sent[1] == sum(x.size for x in jax.tree.leaves(
      _lowered((8, 1, 1), False, scan_layers=False)[1]))


def test_compressed_per_layer_gradients_travel_as_fp8():
  """Each layer's message is the codec's wire (the compressed all-reduce gathers u8 rows at
  these sizes), and the gradients stay within a few FP8 roundings of the plain ones."""
  plain, plain_grads, _ = _loss_and_grads((8, 1, 1), True, scan_layers=False)
  loss, grads, over_data = _loss_and_grads((8, 1, 1), True, CompressionPlan(dp=CODEC),
                                           scan_layers=False)
  assert loss == pytest.approx(plain, rel=F32_TOL)  # the forward pass is not compressed
  assert {c.dtype for c in over_data} == {"u8"}
  assert len([c for c in over_data if c.kind == "all-gather"]) == CFG.n_layers + 1
  flat = lambda t: np.concatenate([x.ravel() for x in jax.tree.leaves(t)])  # noqa: E731
  rel = np.linalg.norm(flat(grads) - flat(plain_grads)) / np.linalg.norm(flat(plain_grads))
  assert 0 < rel < 4 * testing.unit_roundoff(CODEC.fp8_dtype)


@pytest.mark.parametrize("fields, named", [
    (dict(pp=2, microbatches=2), "parallel.pp=1"),
    (dict(microbatches=2), "parallel.microbatches=1"),
    (dict(shard_optimizer=True), "parallel.shard_optimizer=False")])
def test_layouts_that_reduce_more_than_once_are_refused(fields, named):
  args = dict(dp=2, pp=1, tp=1, microbatches=1) | fields
  with pytest.raises(ValueError, match="overlap_grad_reduce") as e:
    step_lib.ParallelSpec(CFG, args.pop("dp"), args.pop("pp"), args.pop("tp"),
                          args.pop("microbatches"), overlap_grad_reduce=True, **args)
  assert named in str(e.value)
