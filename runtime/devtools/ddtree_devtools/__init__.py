"""Development tools for ddtree-runtime, kept out of the wheel that serving hosts install.

``tiny`` (``ddtree-tiny``) builds the tiny target + drafter pairs from ``tiny_corpus`` and
``tiny_templates``; ``server_process`` runs ``ddtree-serve`` as a subprocess on a free port;
``faults`` and ``serve`` are ``ddtree-serve`` with a test fault switch (POST /_test/fault).
"""
