"""dtrain: a PyTorch-native trainer for large language models."""
