"""FLOPs per token (MFU's numerator) and parameter counting, against hand computations."""

from dataclasses import replace

from dtrain.models import count_params
from dtrain.models.llama3 import LLAMA3_FLAVORS, Transformer, matmul_params, num_flops_per_token


def test_flops_per_token_by_hand(tiny_args):
    # dim 64, 2 layers, 4 heads of 16, 2 kv heads, vocab 128; SwiGLU hidden int(8 * 64 / 3) = 170 -> 176 (16s).
    assert tiny_args.ffn_hidden_dim == 176
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176  # wq+wo, wk+wv, w1+w2+w3 = 46_080
    head = 64 * 128
    assert matmul_params(tiny_args) == 2 * per_layer + head == 100_352
    # 6 per matmul parameter, plus causal attention (half of 12 * layers * dim * seq): 6 * 2 * 64 * 32.
    assert num_flops_per_token(tiny_args, seq_len=32) == 6 * 100_352 + 6 * 2 * 64 * 32 == 626_688


def test_tying_does_not_change_flops(tiny_args):
    # The tied head is still a matmul; only the lookup table disappears, and lookups are not counted anyway.
    tied = replace(tiny_args, tie_word_embeddings=True)
    assert num_flops_per_token(tied, 32) == num_flops_per_token(tiny_args, 32)


def test_flops_grow_with_sequence_length_only_through_attention():
    args = LLAMA3_FLAVORS["8B"]
    delta = num_flops_per_token(args, 8192) - num_flops_per_token(args, 4096)
    assert delta == 6 * args.n_layers * args.dim * 4096


def test_count_params_excluding_embedding(tiny_args):
    model = Transformer(tiny_args)
    norms = (2 * tiny_args.n_layers + 1) * tiny_args.dim
    embedding = tiny_args.vocab_size * tiny_args.dim
    assert count_params(model, exclude_embedding=True) == matmul_params(tiny_args) + norms
    assert count_params(model) == matmul_params(tiny_args) + norms + embedding


def test_count_params_of_a_stage_without_embedding(tiny_args):
    model = Transformer(tiny_args)
    model.tok_embeddings = None
    del model.layers["0"]
    assert count_params(model, exclude_embedding=True) == count_params(model) == sum(
        p.numel() for p in model.parameters()
    )
