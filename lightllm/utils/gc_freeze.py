"""Start-up's objects out of Python's cyclic garbage collector."""
import gc


def freeze_start_up_objects() -> None:
    """Collect start-up's garbage once, then move every object alive now (a tokenizer's tables,
    the app, a model with its graphs) to the collector's permanent generation: a full collection
    under load no longer walks them. ~330k such objects took a full collection 350 ms on the
    2-core CI machine, an event-loop (or step-loop) stall each time one ran. vLLM and SGLang
    freeze after start-up too."""
    gc.collect()
    gc.freeze()
