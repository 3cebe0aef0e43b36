"""The applications: the ``zeropipe`` command (``cli``) and its subcommands
(``train``, ``bench``, ``plan_cli``), the data they read, and the reference models.
"""
