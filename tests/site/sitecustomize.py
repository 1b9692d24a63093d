"""Imported first by every Python process the test suite starts (tests/conftest.py puts this folder
first on PYTHONPATH): under TRITON_INTERPRET=1, interpreter_speedup.install() runs at the first
kernel launch of the process (the interpreter's module is wrapped as it is imported; triton is
imported only where a process needs it). Nothing else changes."""

import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    from importlib.abc import MetaPathFinder
    from importlib.machinery import PathFinder

    class _OnInterpreterImport(MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "triton.runtime.interpreter":
                return None
            sys.meta_path.remove(self)
            spec = PathFinder.find_spec(name, path, target)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                first_grid = module.GridExecutor.__call__

                def grid(self, *args, **kwargs):  # the first launch: triton is whole now
                    module.GridExecutor.__call__ = first_grid
                    from interpreter_speedup import install

                    install()
                    return module.GridExecutor.__call__(self, *args, **kwargs)

                module.GridExecutor.__call__ = grid

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _OnInterpreterImport())
