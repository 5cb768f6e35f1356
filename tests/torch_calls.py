"""Recording the torch calls a block makes: nearly every one (its operators, `.numpy()`,
indexing) releases the GIL and waits to take it back, which on a serving thread beside
others is what such a call costs (docs/serving.md, "The GIL")."""
from torch.overrides import TorchFunctionMode


class TorchCalls:
    """The torch functions and tensor methods called inside the block, by name."""

    def __init__(self):
        names = self.names = []

        class Recording(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                names.append(getattr(func, "__name__", str(func)))
                return func(*args, **(kwargs or {}))

        self.mode = Recording()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *failure):
        return self.mode.__exit__(*failure)


# what a call may be and keep the GIL: a tensor's length, shape and values as a list
KEEPS_THE_GIL = {"tolist", "__len__", "__get__"}
