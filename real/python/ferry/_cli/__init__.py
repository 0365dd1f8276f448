"""The commands of ``python -m ferry``: ``main`` dispatches, one module per command of the
package (``trace``, ``auto``, ``validate``, ``probe``), each with a ``main(argv) -> int``."""
