"""Generation on one device: the KV cache reproduces the full forward, greedy decoding equals decoding without a
cache, and sampling honours temperature, top-k, top-p, seeds and EOS."""

from __future__ import annotations

import pytest
import torch

from dtrain.models.attention import CausalSDPA
from dtrain.models.decoding import MIN_TEMPERATURE, Sampling, _keep_top_p, generate
from dtrain.models.kv_cache import CachedAttention, kv_cache
from dtrain.models.llama3 import Transformer
from dtrain.models.qwen3 import Qwen3Args, Qwen3Transformer

QWEN3_TINY = Qwen3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, hidden_dim=96, vocab_size=128,
                       max_seq_len=32)


@pytest.fixture(params=["llama3", "qwen3"])
def model(request, tiny_args) -> torch.nn.Module:
    torch.manual_seed(0)
    built = Transformer(tiny_args) if request.param == "llama3" else Qwen3Transformer(QWEN3_TINY)
    with torch.no_grad():  # larger weights than the init's, so that greedy choices vary from token to token
        for p in built.parameters():
            p.mul_(8.0 if p.ndim > 1 else 1.0)
    return built.eval()


def greedy_without_cache(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    tokens = prompt
    for _ in range(n):
        tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[:, prompt.shape[1]:]


@torch.no_grad()
def test_cached_logits_equal_the_full_forward(model):
    tokens = torch.randint(0, 128, (2, 12))
    full = model(tokens)
    with kv_cache(model, 12) as caches:
        assert len(caches) == 2 and all(isinstance(b.attention.inner_attention, CachedAttention)
                                        for b in model.layers.values())
        pieces = [model(tokens[:, :5], torch.arange(5))]  # a prompt, then a chunk, then single tokens
        pieces.append(model(tokens[:, 5:8], torch.arange(5, 8)))
        pieces += [model(tokens[:, i:i + 1], torch.tensor([i])) for i in range(8, 12)]
        with pytest.raises(ValueError, match="holds 12 tokens; 13 were fed"):
            model(tokens[:, :1], torch.tensor([12]))
    # Logits reach ~30 here; attending over a cache instead of a causal mask sums in another order (fp32).
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-4, rtol=1e-5)
    assert all(isinstance(b.attention.inner_attention, CausalSDPA) for b in model.layers.values())


def test_greedy_generation_equals_decoding_without_a_cache(model):
    prompt = torch.randint(0, 128, (2, 5))
    new = generate(model, prompt, 10)
    assert new.shape == (2, 10)
    with torch.no_grad():
        assert torch.equal(new, greedy_without_cache(model, prompt, 10))
    assert len(set(new[0].tolist())) > 2  # a real test: the sequence is not one token repeated


def test_generation_stops_at_eos_and_pads_finished_rows_with_it(model):
    prompt = torch.randint(0, 128, (2, 5))
    greedy = generate(model, prompt, 10)
    eos = int(greedy[0, 3])
    stopped = generate(model, prompt, 10, eos_ids=(eos,))
    ends = [row.tolist().index(eos) + 1 if eos in row.tolist() else 10 for row in greedy]
    assert stopped.shape[1] == max(ends)
    for row, end in enumerate(ends):
        assert torch.equal(stopped[row, :end], greedy[row, :end])
        assert (stopped[row, end:] == eos).all()
    assert generate(model, prompt[:1], 10, eos_ids=(eos,)).shape[1] == ends[0] <= 4


def test_sampling_is_reproducible_by_seed_and_varies_without_it(model):
    prompt = torch.randint(0, 128, (1, 4))
    hot = Sampling(temperature=5.0)

    def sample(seed: int) -> list[int]:
        return generate(model, prompt, 16, hot, generator=torch.Generator().manual_seed(seed))[0].tolist()

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    greedy = generate(model, prompt, 16)
    # One candidate left (top-k 1, or top-p so small only the most likely token is kept) is greedy decoding.
    for narrow in (Sampling(temperature=5.0, top_k=1), Sampling(temperature=5.0, top_p=1e-6)):
        assert torch.equal(generate(model, prompt, 16, narrow, generator=torch.Generator().manual_seed(3)), greedy)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.2, 0.2]]))
    assert torch.isinf(_keep_top_p(logits, 0.5)).tolist() == [[True, False, True, True]]
    # 0.5 alone falls short of 0.6; adding one 0.2 reaches it (the tie keeps the first of the sorted two).
    kept = ~torch.isinf(_keep_top_p(logits, 0.6))
    assert kept.sum() == 2 and kept[0, 1]
    assert not torch.isinf(_keep_top_p(logits, 1.0 - 1e-6)).any()
    draws = torch.stack([Sampling(temperature=1.0, top_k=2).choose(logits, torch.Generator().manual_seed(s))
                         for s in range(200)])
    assert set(draws.flatten().tolist()) <= {1, 2, 3} and (draws == 1).float().mean() > 0.5


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-1.0), "temperature must be 0 \\(greedy\\) or a finite number >= 1.18e-38"),
    (dict(temperature=float("nan")), "temperature must be 0 .greedy. or a finite number"),
    (dict(temperature=float("inf")), "temperature must be 0 .greedy. or a finite number"),
    (dict(temperature=1e-40), "temperature must be 0 .greedy. or a finite number >= 1.18e-38"),
    (dict(top_k=-2), "top_k must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=float("nan")), r"top_p must be in \(0, 1\]"),
])
def test_sampling_settings_are_checked(bad, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**bad)


def test_the_smallest_temperature_samples_finitely_and_is_greedy(model):
    # Logits of ~30 divided by ~1e-38 would overflow float32 to inf and softmax to NaN without the max subtracted.
    prompt = torch.randint(0, 128, (2, 5))
    for cold in (MIN_TEMPERATURE, 1e-30):
        sampled = generate(model, prompt, 8, Sampling(temperature=cold), generator=torch.Generator().manual_seed(0))
        assert torch.equal(sampled, generate(model, prompt, 8))


def test_ids_past_the_tokenizers_vocabulary_are_never_chosen(model):
    # The embedding's padding rows (a vocabulary rounded up past the tokenizer's) decode to nothing.
    prompt = torch.randint(0, 128, (2, 5))
    greedy = generate(model, prompt, 12)
    limit = int(greedy.max())  # greedy decoding picks at least one id at or past it
    assert int(generate(model, prompt, 12, vocab_size=limit).max()) < limit
    for seed in range(4):
        sampled = generate(model, prompt, 12, Sampling(temperature=50.0), generator=torch.Generator().manual_seed(seed),
                           vocab_size=limit)
        assert int(sampled.max()) < limit


@pytest.mark.cuda
def test_generation_on_cuda_in_bf16_matches_the_cpu_prompt_logits(model):
    prompt = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        reference = model(prompt)
        gpu = model.to("cuda", torch.bfloat16)
        gpu.init_buffers("cuda")
        with kv_cache(gpu, 8):
            cached = gpu(prompt.cuda(), torch.arange(6, device="cuda")).float().cpu()
    # bf16 keeps ~3 significant digits and these logits reach ~30: compare relative to their scale.
    assert (cached - reference).abs().max() < 0.05 * reference.abs().max()
    new = generate(gpu, prompt.cuda(), 8, Sampling(temperature=1.0, top_p=0.9),
                   generator=torch.Generator("cuda").manual_seed(0))
    assert new.shape == (1, 8) and new.device.type == "cuda"
