"""What the stateful KV cache machines draw from: prompts over a tiny vocabulary, often
extending fixed prefixes, and layouts of KV cache groups."""

from hypothesis import strategies as st

VOCAB = 3  # a tiny vocabulary makes shared blocks, and so cache hits, common
PREFIXES = [[], [0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0], [1, 0]]
_LAYOUTS = [("full",), ("window",), ("full", "window"), ("window", "full", "window")]
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=12)


@st.composite
def group_layouts(draw) -> tuple[tuple[str, ...], list[int | None]]:
    """(layout, group_windows): a layout of KV cache groups, each "full" attention or a sliding
    "window", and each group's window (None: full attention), windows of 2 to 10 tokens."""
    layout = draw(st.sampled_from(_LAYOUTS))
    windows = iter(draw(st.lists(st.integers(2, 10), min_size=2, max_size=2)))
    return layout, [None if kind == "full" else next(windows) for kind in layout]
