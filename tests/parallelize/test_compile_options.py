"""The [compile] options: each reaches torch.compile, impossible ones are refused in one line, and model_whole
(with a non-default mode and dynamic shapes) trains to the eager losses."""

import pytest
import torch

from dtrain.models.llama3 import Llama3Args, Transformer
from dtrain.parallelize import ParallelDims, ParallelismError, ParallelizeOptions, apply_compile, compile_kwargs
from dtrain.parallelize.compile import check_compile_options
from tests.e2e.run_train_helpers import FP32, read_metrics, run_train

# A 2-layer, dim-64 Llama on 16-token sequences: each cold compile stays a few seconds.
TINY_MODEL = ["--model.args.n_layers", "2", "--model.args.dim", "64", "--model.args.n_heads", "4",
              "--model.args.n_kv_heads", "2", "--training.seq_len", "16", "--training.local_batch_size", "2",
              "--training.steps", "4", "--metrics.log_freq", "1", *FP32]


def test_config_values_become_torch_compile_arguments():
    assert compile_kwargs("inductor", "max-autotune-no-cudagraphs", False, "true") == dict(
        backend="inductor", mode="max-autotune-no-cudagraphs", fullgraph=False, dynamic=True
    )
    assert compile_kwargs("inductor", dynamic="false")["dynamic"] is False
    assert compile_kwargs("inductor", dynamic="auto")["dynamic"] is None  # torch's default: static, then dynamic


def tiny_model() -> Transformer:
    with torch.device("meta"):
        return Transformer(Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256))


@pytest.fixture
def compile_calls(monkeypatch):
    """Every nn.Module.compile call as (module, kwargs), without compiling anything."""
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: calls.append((self, kwargs)))
    return calls


@pytest.mark.parametrize("granularity", ["per_block", "model_whole"])
def test_each_option_reaches_torch_compile_for_each_unit(compile_calls, granularity):
    model = tiny_model()
    apply_compile(model, granularity, backend="inductor", mode="max-autotune-no-cudagraphs", fullgraph=False,
                  dynamic="auto")
    units = [model] if granularity == "model_whole" else list(model.layers.values())
    assert [module for module, _ in compile_calls] == units
    for _, kwargs in compile_calls:
        assert kwargs == dict(backend="inductor", mode="max-autotune-no-cudagraphs", fullgraph=False, dynamic=None)


def test_parallelize_passes_the_options(compile_calls):
    from dtrain.parallelize import get_family

    options = ParallelizeOptions(compile_model=True, compile_fullgraph=True, compile_dynamic="true",
                                 compile_granularity="model_whole")
    get_family("llama3").parallelize(tiny_model(), None, ParallelDims(1), options)
    ((_, kwargs),) = compile_calls
    assert kwargs == dict(backend="inductor", mode="default", fullgraph=True, dynamic=True)


@pytest.mark.parametrize(
    "args, message",
    [
        (("reduce-overhead", "inductor", "cpu", "per_block", False),
         "compile.mode='reduce-overhead' captures CUDA graphs and needs a CUDA device, not cpu "
         "(use max-autotune-no-cudagraphs or default)"),
        (("max-autotune", "inductor", "cpu", "per_block", False), "compile.mode='max-autotune' captures CUDA graphs"),
        (("max-autotune-no-cudagraphs", "aot_eager", "cpu", "per_block", False),
         "compile.mode='max-autotune-no-cudagraphs' is an inductor option that compile.backend='aot_eager' ignores"),
        (("default", "inductor", "cpu", "model_whole", True),
         "compile.granularity='model_whole' with compile.fullgraph = true cannot run under FSDP or DDP"),
    ],
)
def test_impossible_options_are_refused_in_one_line(args, message):
    mode, backend, device, granularity, data_parallel = args
    with pytest.raises(ParallelismError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as err:
        check_compile_options(mode, "false", granularity, backend, device, fullgraph=True,
                              data_parallel=data_parallel)
    assert "\n" not in str(err.value)


def test_cuda_graph_modes_pass_on_cuda_and_model_whole_without_data_parallel():
    for mode in ("reduce-overhead", "max-autotune"):
        check_compile_options(mode, "false", "per_block", "inductor", "cuda", fullgraph=True, data_parallel=False)
    check_compile_options("default", "false", "model_whole", "inductor", "cpu", fullgraph=True, data_parallel=False)
    check_compile_options("default", "false", "model_whole", "inductor", "cpu", fullgraph=False, data_parallel=True)


def test_a_cuda_graph_mode_on_cpu_is_refused_before_anything_is_written(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    run_dir = tmp_path / "run"
    result = run_train("--compile.enable", "--compile.mode", "reduce-overhead", "--compile.components", "loss",
                       "--job.dump_folder", str(run_dir))
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: compile.mode='reduce-overhead' captures CUDA graphs and needs a CUDA device, not cpu "
        "(use max-autotune-no-cudagraphs or default)"
    )
    assert not run_dir.exists()


@pytest.mark.slow
def test_model_whole_with_autotune_and_dynamic_shapes_trains_to_the_eager_losses(tmp_path):
    eager = run_train(*TINY_MODEL, "--job.dump_folder", str(tmp_path / "eager"))
    assert eager.returncode == 0, eager.stderr[-2000:]
    compiled = run_train(
        *TINY_MODEL, "--compile.enable", "--compile.granularity", "model_whole", "--compile.mode",
        "max-autotune-no-cudagraphs", "--compile.dynamic", "auto", "--job.dump_folder", str(tmp_path / "compiled"),
    )
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    expected = [m["loss"] for m in read_metrics(tmp_path / "eager")]
    losses = [m["loss"] for m in read_metrics(tmp_path / "compiled")]
    assert losses == pytest.approx(expected, rel=1e-4)
    assert "0 graph break(s), 0 recompile(s)" in compiled.stderr + compiled.stdout
