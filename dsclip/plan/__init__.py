"""``dsclip plan``: what fits on each GPU, and how fast it runs, before a big job is queued.

    dsclip plan --model ViT-bigG-14 --gpus 256 --gpu-memory 80 --batch-size 64 --accum-freq 2 | --max-batch \
        [--zero 2|3] [--precision bf16] [--grad-checkpointing] [--force-patch-dropout 0.5] \
        [--loss infonce|infonce_local|infonce_tiled|siglip] [--mfu MEASURED] [--peak-tflops 790]

Everything is computed from the architecture: no GPU, no weights, no DeepSpeed engine. The command line is
dsclip/cli/plan.py (dsclip train's flag names with their meanings); the rehearsal that runs rank 0 of a
planned job under a fake world is dsclip/rehearsal/, above this package. Here, one module per concern:

* architecture: a model's shapes and parameter counts (the model built on the meta device)
* memory: per-GPU bytes of model states, gradients, activations, loss buffers and the embedding cache
* flops: FLOPs per sample of the towers and the loss
* comm: what one rank sends per step, and how long that takes on the cluster's links
* efficiency: the MFU a plan predicts its step time with (measured rows), ZeRO-Offload's cost, the GPU table
* planner: one Plan (memory budget, step time, notes, the ``dsclip train`` command); the largest batch
* search: the fastest configuration that fits, the cheapest change when the user's does not
* report: the plan and the search as ``dsclip plan`` prints them

Nothing here imports DeepSpeed, the trainer, the rehearsal or the CLI (tests/unit/test_layering.py).
"""
