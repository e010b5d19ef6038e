"""The functional core: the training step, how it runs on a layout, the state it advances, optimizer, LR schedule,
RNG and the non-finite guard. No JobConfig and no mesh construction here."""
