"""Fault-tolerant training over replica groups with torchft: the groups, live recovery, semi-synchronous methods."""
