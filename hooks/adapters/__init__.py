"""Framework adapters: each turns the Guard's checkpoint/resume hooks into one framework's save and load.

- `torch_dcp.TorchDCPAdapter`: torch.distributed.checkpoint (DDP, FSDP2), reshards on resume.
  `dcp_state.StateCapture` gives it `get_state_dict`'s state without the per-call name mapping.
- `deepspeed.DeepSpeedAdapter`: DeepSpeed engines, ZeRO-1/2 resume at any DP world size.
- `plain_torch.PlainTorchAdapter`: single-process jobs.
Import the one you use from its module (each pulls in its framework only then).
"""
