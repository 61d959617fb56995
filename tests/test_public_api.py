"""The package's lazy public names stay what they are after the modules behind them are imported."""
import importlib


def test_public_functions_survive_submodule_imports():
    import msparallel_ds as msp

    for module in ("engine", "strategy", "checkpoint.hf", "checkpoint", "checkpoint.convert", "runtime",
                   "pipeline.engine", "interleave.multi_copy"):
        importlib.import_module(f"msparallel_ds.{module}")
    for name in ("parallelize", "initialize", "from_pretrained", "init_parallel", "shard_batch"):
        assert callable(getattr(msp, name)) and not hasattr(getattr(msp, name), "__path__"), name
    assert msp.parallelize.__module__ == "msparallel_ds.strategy"
