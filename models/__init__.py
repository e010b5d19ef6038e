"""Single-device model families in plain PyTorch, installed as dtrain.models; nothing here imports torch.distributed."""
