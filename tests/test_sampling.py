import pytest
import torch

from sluice.engine.sampling import Sampler, SamplingParams
from sluice.errors import InvalidOptionError


def test_greedy_is_argmax():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert Sampler(SamplingParams(temperature=0))(logits) == int(logits.argmax())


def test_top_k_one_is_greedy():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    assert all(Sampler(SamplingParams(temperature=1.5, top_k=1, seed=s))(logits) == int(logits.argmax())
               for s in range(5))


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen = {Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=s))(logits) for s in range(200)}
    assert seen == {0, 1}


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.07, 0.03]))
    seen = {Sampler(SamplingParams(temperature=1.0, min_p=0.1, seed=s))(logits) for s in range(200)}
    assert seen == {0, 1, 2}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1])
    s = Sampler(SamplingParams(temperature=1.0, seed=7))
    counts = torch.bincount(torch.tensor([s(probs.log()) for _ in range(3000)]), minlength=3).float() / 3000
    assert torch.allclose(counts, probs, atol=0.03)


def test_repetition_penalty_hf_convention():
    logits = torch.tensor([2.0, 1.9, -1.0])
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0))
    assert s(logits.clone(), history=[0]) == 1  # 2.0 / 2 = 1.0 < 1.9


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(min_p=1.0),
                                dict(repetition_penalty=0)])
def test_out_of_range(kw):
    with pytest.raises(InvalidOptionError):
        SamplingParams(**kw).validate()


@pytest.mark.parametrize("kw", [
    dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature=1e-30), dict(temperature=1e9),
    dict(temperature=True), dict(temperature="0.7"),
    dict(top_k=2**63), dict(top_k=2**31), dict(top_k=1.5), dict(top_k=True),
    dict(top_p=float("nan")), dict(min_p=float("nan")), dict(min_p=float("-inf")),
    dict(repetition_penalty=float("nan")), dict(repetition_penalty=float("inf")), dict(repetition_penalty=1e-30),
    dict(repetition_penalty=10**400),
    dict(presence_penalty=float("nan")), dict(frequency_penalty=float("inf")),
    dict(seed=2**64), dict(seed=-(2**63) - 1), dict(seed=1.5), dict(seed="7"),
])
def test_non_finite_and_unpackable_values_are_refused(kw):
    """NaN passes `< 0` checks and 2**63 overflows the sampler's int64 packing: both are refused, naming the option."""
    name = next(iter(kw))
    with pytest.raises(InvalidOptionError, match=f"^{name}="):
        SamplingParams(**kw).validate()


def test_edges_that_stay_valid():
    for kw in (dict(temperature=0), dict(temperature=1e-4), dict(temperature=100), dict(top_k=2**31 - 1),
               dict(seed=2**64 - 1), dict(seed=-(2**63)), dict(repetition_penalty=0.01), dict(presence_penalty=-2)):
        SamplingParams(**kw).validate()
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    assert Sampler(SamplingParams(temperature=1.0, top_k=2**31 - 1, seed=2**64 - 1))(logits) in range(50)
