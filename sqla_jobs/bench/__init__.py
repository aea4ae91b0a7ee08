"""``sqla-jobs bench`` and ``sqla-jobs bench --soak``: benchmark tooling, loaded only by that command and by
the scripts in docs/bench/, never by the library itself."""
