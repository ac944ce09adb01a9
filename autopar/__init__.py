"""autopar: plan and compile a single-device PyTorch transformer into a 3-D parallel program.

    prog = autopar.parallelize(model, gpus=512, example_inputs=(ids,),
                               loss_fn=autopar.cross_entropy, global_batch_size=1536)
    print(prog.plan); print(prog.plan.explain())
"""
from autopar.plan import Alternative, Memory, Plan, Prediction, Stage

__all__ = ["parallelize", "ParallelProgram", "Plan", "Stage", "Prediction", "Memory",
           "Alternative", "Cluster", "meta_init", "cross_entropy", "load_plan", "get_cluster",
           "scale_sweep", "load_cluster", "save_cluster", "tune", "PackedDocuments"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: `import autopar.runtime...` (every rank of a job) must not pull in
    # the compiler (capture, passes, cost model, solver), and `import autopar` stays light: it
    # imports no torch (the `autopar` command pauses the cyclic collector before torch loads:
    # autopar/cli.py; tests/unit/test_import_cost.py).
    if name == "cross_entropy":
        from autopar.losses import cross_entropy
        return cross_entropy
    if name in ("parallelize", "ParallelProgram", "load_plan"):
        from autopar import api
        return getattr(api, name)
    if name == "scale_sweep":
        from autopar.scaling import scale_sweep
        return scale_sweep
    if name == "meta_init":
        from autopar.runtime.shard import meta_init
        return meta_init
    if name == "PackedDocuments":
        from autopar.documents import PackedDocuments
        return PackedDocuments
    if name == "tune":
        from autopar.tuning import tune
        return tune
    if name in ("Cluster", "get_cluster", "load_cluster", "save_cluster"):
        from autopar.cost import hardware
        return getattr(hardware, name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
