"""One line in the training code people already run: spotguard for the Hugging Face Trainer
(`hf.SpotguardCallback`), Accelerate (`accelerate.AccelerateGuard`) and PyTorch Lightning
(`lightning.SpotguardCallback`).

Each integration drives the same Guard as a hand-written loop (`spotguard.hooks.Guard`): at each
step end every rank agrees (piggybacked on DDP's gradient all_reduce where the framework runs
DDP), and on an agreed notice every rank saves the same step through the framework's own call,
then the run drains with exit 83 (84 when the save failed) and the sidecar is told. Installed by
the extras `spotguard[hf]` and `spotguard[lightning]`; not part of the product image.
"""
