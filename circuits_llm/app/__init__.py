"""The application: the ``circuits-llm`` command line, the demo and bench comparisons, their
reports and plots, and the cache of trained heads. The top floor: it uses decoding and training,
and nothing below imports it."""
