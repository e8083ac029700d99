"""The vllm backend's measured choice between batchjob's attention kernel and vLLM's
(backends/vllm/attention_choice.py): real timings of both kernels on this CPU, the rule that
turns them into a choice, the cache, and the switches that override it."""

from __future__ import annotations

import json

import pytest
import torch

from batchjob.backends.native.attention import calibrate as calib
from tests.backends.vllm.vllm_kit import needs_vllm

pytestmark = [needs_vllm]


@pytest.fixture
def ac(tmp_path, monkeypatch):
    """The module, with a calibration file of this test's own (the kernel library stays where
    it is built)."""
    from batchjob.backends.vllm import attention_choice

    kn = attention_choice.pa.kernel()
    if kn is None:
        pytest.skip("no C compiler: the backend stays vLLM's")
    cal = calib.Calibration(kn.path)
    cal.path = tmp_path / "calibration.json"
    monkeypatch.setitem(calib._CALIBRATIONS, calib.cache_dir() / kn.path.name, cal)
    monkeypatch.delenv(attention_choice.pa.ENV_SWITCH, raising=False)
    monkeypatch.delenv(calib.ENV, raising=False)
    return attention_choice


def test_a_step_shares_each_groups_prefix_blocks(ac):
    nblocks, table, seq, qsl = ac.step_batch(3, 4, 64, 20, 5, block_size=16)
    assert table.shape == (12, 4 + 2) and nblocks == 3 * 4 + 12 * 2 + 1
    assert (seq == 84).all() and qsl.tolist() == list(range(0, 61, 5))
    prefixes = {tuple(row[:4].tolist()) for row in table}
    assert len(prefixes) == 3  # one run of prefix blocks per group, 4 members each
    own = table[:, 4:].flatten().tolist()
    assert len(set(own)) == len(own) and 0 not in own  # own blocks apart; block 0 unused
    assert not set(own) & {b for p in prefixes for b in p}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_both_kernels_are_timed_and_the_class_cached(ac, dtype, monkeypatch):
    choice = ac.choose(8, 2, 64, 32, dtype)
    assert choice.kernel_ms is not None and choice.vllm_ms is not None
    assert choice.kernel_ms > 0 and choice.vllm_ms > 0
    assert choice.kernel == (choice.kernel_ms <= ac.MARGIN * choice.vllm_ms)
    cached = json.loads(calib.calibration_for(ac.pa.kernel().path).path.read_text())
    keys = [k for k in cached["classes"] if k.startswith("vllm-attention/")]
    # no job: the shared steps alone are weighed, so measured
    assert {k.rsplit("/", 1)[1] for k in keys} == {k for k, w in ac.WEIGHTS.items() if w > 0}
    assert all(f"/{dtype}/" in k for k in keys)

    def measured_again(cls):
        raise AssertionError(f"{cls.key} measured again")

    monkeypatch.setattr(ac, "measure", measured_again)
    assert ac.choose(8, 2, 64, 32, dtype) == choice  # from the cache


@pytest.mark.parametrize(
    ("kernel_ms", "vllm_ms", "kernel"),
    [
        ({"decode": 1.0, "prefill": 10.0}, {"decode": 2.0, "prefill": 12.0}, True),
        # faster decode steps do not outweigh prefill steps twice as slow
        ({"decode": 1.0, "prefill": 20.0}, {"decode": 2.0, "prefill": 10.0}, False),
        # within the margin: the kernel stays
        ({"decode": 1.0, "prefill": 10.4}, {"decode": 1.0, "prefill": 10.0}, True),
        ({"decode": 3.0, "prefill": 10.0}, {"decode": 1.0, "prefill": 10.0}, False),
    ],
)
def test_the_choice_weighs_decode_and_prefill_steps(ac, kernel_ms, vllm_ms, kernel, monkeypatch):
    def measured(cls):
        k, v = kernel_ms[cls.kind], vllm_ms[cls.kind]
        return calib.Decision(k <= v, k, v)

    monkeypatch.setattr(ac, "measure", measured)
    choice = ac.choose(8, 2, 64, 32, "float32")
    assert choice.kernel is kernel
    w = ac.WEIGHTS
    assert choice.kernel_ms == pytest.approx(sum(w[k] * kernel_ms[k] for k in kernel_ms))
    assert choice.vllm_ms == pytest.approx(sum(w[k] * vllm_ms[k] for k in vllm_ms))


@pytest.mark.parametrize(
    ("decode_tokens", "prefill_tokens", "kernel"),
    [
        (64_000, 20_000, True),  # mostly decode: the kernel's faster decode steps decide
        (2_000, 200_000, False),  # mostly prefill: vLLM's faster prefill steps decide
        (0, 0, True),  # no tokens known: three decode steps per prefill step
    ],
)
def test_the_jobs_own_mix_weighs_the_steps(ac, decode_tokens, prefill_tokens, kernel, monkeypatch):
    kernel_ms, vllm_ms = {"decode": 1.0, "prefill": 24.0}, {"decode": 3.0, "prefill": 20.0}

    def measured(cls):
        return calib.Decision(False, kernel_ms[cls.kind], vllm_ms[cls.kind])

    monkeypatch.setattr(ac, "measure", measured)
    mix = ac.JobMix(decode_tokens, prefill_tokens)
    choice = ac.choose(8, 2, 64, 32, "float32", mix)
    assert choice.kernel is kernel
    w = mix.weights()
    assert choice.weights == w
    if decode_tokens:  # steps of the timed sizes: 128 query tokens a decode, 2,048 a prefill
        assert w == {
            "decode": decode_tokens / 128, "decode_alone": 0.0,
            "prefill": prefill_tokens / 2048, "prefill_alone": 0.0,
        }  # fmt: skip
    else:
        assert w == ac.WEIGHTS
    assert choice.kernel_ms == pytest.approx(sum(w[k] * kernel_ms[k] for k in kernel_ms))
    assert choice.vllm_ms == pytest.approx(sum(w[k] * vllm_ms[k] for k in vllm_ms))


@pytest.mark.parametrize(("shared", "kernel"), [(1.0, True), (0.0, False), (0.5, True)])
def test_a_job_that_shares_little_follows_the_unshared_steps(ac, shared, kernel, monkeypatch):
    """The kernel ahead where a document is shared, behind where nothing is: the job's
    sharing decides, and only the kinds it weighs are measured."""
    kernel_ms = {"decode": 1.0, "decode_alone": 0.75, "prefill": 10.0, "prefill_alone": 14.0}
    vllm_ms = {"decode": 2.0, "decode_alone": 0.5, "prefill": 12.0, "prefill_alone": 12.0}
    measured_kinds = []

    def measured(cls):
        measured_kinds.append(cls.kind)
        return calib.Decision(False, kernel_ms[cls.kind], vllm_ms[cls.kind])

    monkeypatch.setattr(ac, "measure", measured)
    mix = ac.JobMix(12_800, 20_480, decode_shared=shared, prefill_shared=shared)
    choice = ac.choose(8, 2, 64, 32, "float32", mix)
    assert choice.kernel is kernel
    w = mix.weights()
    assert set(measured_kinds) == {k for k in ac.STEPS if w[k] > 0}
    assert choice.kernel_ms == pytest.approx(sum(w[k] * kernel_ms[k] for k in measured_kinds))


def test_switches_decide_without_measuring(ac, monkeypatch):
    def never(cls):
        raise AssertionError("measured")

    monkeypatch.setattr(ac, "measure", never)
    monkeypatch.setenv(ac.pa.ENV_SWITCH, "0")
    assert not ac.choose(8, 2, 64, 32, "bfloat16").kernel
    monkeypatch.setenv(ac.pa.ENV_SWITCH, "1")
    assert ac.choose(8, 2, 64, 32, "bfloat16").kernel
    monkeypatch.delenv(ac.pa.ENV_SWITCH)
    monkeypatch.setenv(calib.ENV, "0")
    assert ac.choose(8, 2, 64, 32, "bfloat16").kernel


def test_shapes_the_kernel_does_not_take_stay_vllms(ac, monkeypatch):
    monkeypatch.setattr(ac, "measure", lambda cls: pytest.fail("measured"))
    lanes = ac.pa.kernel().lanes
    assert not ac.choose(8, 2, lanes + lanes // 2, 32, "float32").kernel  # off the vector
    assert not ac.choose(8, 2, 64, 32, "float16").kernel  # fp16 caches stay vLLM's
    assert not ac.choose(8, 3, 64, 32, "float32").kernel  # query heads not a multiple


def test_measuring_runs_one_thread_and_restores_torchs(ac):
    before = torch.get_num_threads()
    import vllm

    cls = ac.AttentionClass(vllm.__version__, ac.pa.kernel().isa, 8, 2, 64, 32, "float32", "decode")
    d = ac.measure(cls)
    assert d.kernel_ms > 0 and d.torch_ms > 0
    assert torch.get_num_threads() == before


def test_a_measurement_that_fails_keeps_the_kernel(ac, monkeypatch):
    """A vLLM whose CPU attention ops differ must not stop the engine from starting."""

    def broken(cls):
        raise AttributeError("_C has no attribute cpu_attention_with_kv_cache")

    monkeypatch.setattr(ac, "measure", broken)
    choice = ac.choose(8, 2, 64, 32, "float32")
    assert choice.kernel and "not measured" in choice.reason
