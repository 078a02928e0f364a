"""The training step the recording and replay tests build their models into."""


def training_step(model, optimizer, loss_fn, inputs, target):
    """step(): zero_grad(set_to_none=True), forward, loss, backward, optimizer
    step; returns the loss (so it outlives the step when the caller keeps it)."""

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), target)
        loss.backward()
        optimizer.step()
        return loss

    return step
