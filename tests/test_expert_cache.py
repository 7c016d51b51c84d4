"""The expert slot cache's kernels (`kernels/expert_cache`) against the torch policy, step by step on fresh random
routings: under the Triton interpreter on CPU, with the host side in page-locked memory on a GPU."""

import pytest
import torch

triton = pytest.importorskip("triton")

from sluice.kernels.expert_cache import reference  # noqa: E402
from sluice.kernels.expert_cache import triton as ect  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def state(E, S, device):
    return {"slot_of": torch.full((E,), -1, dtype=torch.int32, device=device),
            "expert_in": torch.full((S,), -1, dtype=torch.int32, device=device),
            "stamp": torch.zeros(S, dtype=torch.int64, device=device),
            "clock": torch.zeros(1, dtype=torch.int64, device=device),
            "stats": torch.zeros(2, dtype=torch.int64, device=device)}


def routing(g, T, k, E, shared: int):
    """ids [T, k + shared]: k routed experts, then the shared expert's slots E..E+shared-1."""
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    return torch.cat([ids, torch.arange(E, E + shared, dtype=torch.int32).expand(T, shared)], 1)


@pytest.mark.parametrize("E,S,k,T,shared", [(16, 6, 2, 3, 0), (64, 30, 10, 3, 1), (40, 40, 4, 1, 1), (24, 10, 3, 2, 2),
                                            (300, 70, 8, 8, 0)])
def test_resolve_kernel_matches_the_policy(E, S, k, T, shared):
    g = torch.Generator().manual_seed(E * 100 + S + T)
    ref, dev = state(E, S, "cpu"), state(E, S, DEVICE)
    jobs = torch.zeros(2, T * k, dtype=torch.int32, device=DEVICE)
    n_jobs = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    scratch = torch.empty(triton.next_power_of_2(S), dtype=torch.int64, device=DEVICE)
    for step in range(12):
        # every third step reuses the last one's experts (all hits), the others route afresh
        reused = step > 0 and step % 3 == 0
        if not reused:
            ids = routing(g, T, k, E, shared)
        want, missed, victims = reference.resolve(ids, k, **ref)
        got = ect.resolve(ids.to(DEVICE), k, **dev, jobs=jobs, n_jobs=n_jobs, scratch=scratch)
        assert torch.equal(got.cpu(), want), step
        for name in ref:
            assert torch.equal(dev[name].cpu(), ref[name]), (step, name)
        m = int(n_jobs)
        assert m == missed.numel()
        if reused:  # the last step left every expert it routed in a slot
            assert m == 0, step
        assert torch.equal(jobs[0, :m].cpu().long(), missed) and torch.equal(jobs[1, :m].cpu().long(), victims)
        slots = got[:, :k].long().cpu()
        assert torch.equal(ref["expert_in"][slots].to(torch.int32), ids[:, :k])  # every routed expert is in its slot
        assert torch.equal(got[:, k:].cpu(), torch.arange(S, S + shared, dtype=torch.int32).expand(T, shared))
    hits, misses = ref["stats"].tolist()
    assert misses >= k and hits > 0


def test_resolve_refuses_more_experts_than_slots():
    with pytest.raises(ValueError, match="more than the 4 slots"):
        reference.resolve(torch.arange(6, dtype=torch.int32)[None], 6, **state(8, 4, "cpu"))


def test_fill_copies_the_missed_experts_into_their_slots():
    g = torch.Generator().manual_seed(3)
    E, S = 12, 5
    host = [torch.randint(-2**31, 2**31, (E, 8, 6), generator=g, dtype=torch.int32).view(torch.uint32),
            torch.randn(E, 8, 2, generator=g).to(torch.bfloat16), torch.randn(E, 8, 2, generator=g).to(torch.bfloat16),
            torch.randint(-2**31, 2**31, (E, 6, 2), generator=g, dtype=torch.int32).view(torch.uint32),
            torch.randn(E, 6, 4, generator=g).to(torch.bfloat16), torch.randn(E, 6, 4, generator=g).to(torch.bfloat16)]
    if DEVICE == "cuda":
        host = [t.pin_memory() for t in host]
    slots = [torch.zeros((S, *t.shape[1:]), dtype=t.dtype, device=DEVICE) for t in host]
    jobs = torch.tensor([[7, 2, 11, 0, 0], [4, 0, 2, 0, 0]], dtype=torch.int32, device=DEVICE)
    ect.fill(host, slots, jobs, torch.tensor([3], dtype=torch.int32, device=DEVICE))
    for h, s in zip(host, slots):
        for e, slot in ((7, 4), (2, 0), (11, 2)):
            assert torch.equal(s[slot].cpu().view(torch.int16 if s.element_size() == 2 else torch.int32),
                               h[e].view(torch.int16 if h.element_size() == 2 else torch.int32))
        assert not s[1].cpu().view(torch.uint8).any() and not s[3].cpu().view(torch.uint8).any()
