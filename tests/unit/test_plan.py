"""Pure tests of the Plan dataclass: validation messages, JSON round-trip, rendering."""
import dataclasses

import pytest

from autopar.plan import Alternative, Memory, Plan, Prediction, Stage


def _prediction(step=1.0) -> Prediction:
    return Prediction(step_time_s=step, tflops_per_gpu=100.0, mfu=0.3, bubble_fraction=0.1,
                      memory_bytes_per_gpu=40e9, compute_s=0.8 * step, tp_comm_s=0.05 * step,
                      pp_comm_s=0.02 * step, dp_comm_s=0.03 * step, bubble_s=0.1 * step,
                      memory=Memory(weights_bytes=10e9, gradients_bytes=10e9,
                                    optimizer_bytes=10e9, activations_bytes=10e9))


def _stages(p: int, v: int, layers: int) -> tuple[Stage, ...]:
    chunks = p * v
    bounds = [round(i * layers / chunks) for i in range(chunks + 1)]
    return tuple(Stage(chunk=c, rank=c % p, first_layer=bounds[c], last_layer=bounds[c + 1],
                       embedding=c == 0, head=c == chunks - 1) for c in range(chunks))


def make_plan(**over) -> Plan:
    kw = dict(t=2, p=2, d=2, v=2, micro_batch_size=1, num_microbatches=4,
              schedule="interleaved-1f1b", recompute="selective", sequence_parallel=True,
              zero=1, stages=_stages(2, 2, 8), predicted=_prediction(), global_batch_size=8,
              seq_len=16, cluster="local-cpu", model="tiny", num_layers=8,
              alternatives=(Alternative(config={"t": 2, "p": 2, "d": 2}, predicted=_prediction(1.2),
                                        feasible=True, reason=""),
                            Alternative(config={"t": 8, "p": 1, "d": 1}, predicted=None,
                                        feasible=False, reason="memory: needs 90 GiB > 80 GiB")))
    kw.update(over)
    return Plan(**kw)


def test_json_round_trip_is_exact():
    plan = make_plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.alternatives == plan.alternatives
    assert again.predicted.memory == plan.predicted.memory


def test_plan_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_plan().t = 4  # type: ignore[misc]


@pytest.mark.parametrize("over, words", [
    (dict(global_batch_size=10), ["global_batch_size=10", "split exactly"]),
    (dict(schedule="zigzag"), ["schedule='zigzag'", "one of"]),
    (dict(recompute="some"), ["recompute='some'"]),
    (dict(zero=4), ["zero=4"]),   # the levels are 0-3
    (dict(v=2, schedule="1f1b"), ["v=2", "interleaved-1f1b"]),
    (dict(t=0), ["Plan.t=0", "positive"]),
    (dict(stages=_stages(2, 1, 8)), ["2 chunks", "p·v"]),
    (dict(num_layers=9), ["9 layers", "cover every layer"]),
])
def test_validation_names_value_rule_and_fix(over, words):
    with pytest.raises(ValueError) as err:
        make_plan(**over)
    for w in words:
        assert w in str(err.value)


def test_stage_placement_rule_is_checked():
    bad = list(_stages(2, 2, 8))
    bad[1] = dataclasses.replace(bad[1], rank=0)
    with pytest.raises(ValueError, match="c mod p"):
        make_plan(stages=tuple(bad))


def test_table_and_explain_show_the_essentials():
    import autopar.report  # noqa: F401 - the plan's text lives there (alone, nothing loaded it)
    plan = make_plan()
    text = str(plan)
    for w in ["t=2", "p=2", "d=2", "v=2", "interleaved-1f1b", "chunk   0", "embedding",
              "head+loss", "TFLOP/s", "MFU", "bubble", "memory/GPU", "activations"]:
        assert w in text, w
    why = plan.explain()
    assert "+20.0%" in why            # the slower alternative, relative to the chosen plan
    assert "memory: needs 90 GiB" in why


def test_folded_stage_lines_say_where_chunks_run_in_words():
    from autopar.report import _stage_lines
    from programs import make_plan
    lines = _stage_lines(make_plan(p=2, v=4, layers=8, schedule="interleaved-1f1b"))
    assert "    chunks   1-6   on all 2 pipeline ranks (chunk c on rank c mod 2): 1 layer each, " \
           "layers [1, 7)" in lines, lines
    three = _stage_lines(make_plan(p=4, v=2, layers=8, schedule="interleaved-1f1b"))   # chunks 1-6 cover all 4 ranks too
    assert not any("…" in ln or "(s)" in ln for ln in lines + three), three


def test_explain_table_uses_one_time_unit():
    from autopar.report import _reason_in_unit, _table_unit
    unit = _table_unit(0.00555)                          # the chosen step: milliseconds
    assert _reason_in_unit("slower: 0.005547 s vs 0.00555 s", unit) == \
        "slower: 5.547 ms vs 5.55 ms"
    assert _reason_in_unit("p=3 does not divide 8 layers", unit) == "p=3 does not divide 8 layers"


def test_a_plan_records_its_elementwise_pricing_and_eager_gpu_chunks_of_a_fused_one_are_named():
    """On an H100 eager chunks of a plan priced fused (the GPU presets') kept more activations
    than priced and a plan at the memory limit ran out: the plan records how it priced
    elementwise ops, and compile() warns, on a GPU, when its chunks run otherwise."""
    import torch

    from autopar.compile import eager_chunks_of_a_fused_plan
    from autopar.cost.profile import transformer_profile
    from autopar.cost.solver import solve
    prof = transformer_profile(num_layers=2, hidden=64, heads=4, seq_len=32, vocab=128)
    gpu = solve(prof, "dgx-h100-80gb", gpus=1, global_batch_size=4)
    cpu = solve(prof, "local-cpu", gpus=1, global_batch_size=4)
    assert (gpu.elementwise, cpu.elementwise) == ("fused", "eager")
    assert Plan.from_json(gpu.to_json()).elementwise == "fused"
    cuda, host = torch.device("cuda", 0), torch.device("cpu")
    line = eager_chunks_of_a_fused_plan(gpu, False, cuda)
    assert "fused elementwise" in line and "torch_compile=True" in line and "\n" not in line
    assert eager_chunks_of_a_fused_plan(gpu, True, cuda) is None          # compiled: as priced
    assert eager_chunks_of_a_fused_plan(gpu, False, host) is None         # not on a GPU
    assert eager_chunks_of_a_fused_plan(cpu, False, cuda) is None         # priced eager
    old = dataclasses.replace(gpu, elementwise=None)                      # a plan from before
    assert eager_chunks_of_a_fused_plan(old, False, cuda) is None
