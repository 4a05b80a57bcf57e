"""The measured core: what a student reads to see how each number is taken.

It imports nothing of the lab above it (``tests/test_architecture.py`` checks). The layer table
of ``docs/developing.md`` says what each module owns: ``loop`` (THE step loop, epoch
driver and evaluation), ``ranks`` (the one aggregation over ranks), ``metrics`` (the glossary),
``records``, ``timing``, ``comm_hooks``, ``dist``, ``ring``, ``data``, the machine (``hardware``,
``environment``, ``cuda_builds``) and the settings and checks around them.
"""
