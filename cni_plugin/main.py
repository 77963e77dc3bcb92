"""Console-script entry point: ``flannelpy-cni = cni_plugin.main:main``.

A pip-installed console script starts through site and the package import, so it
is slower than the launcher that ``client.write_launcher`` installs (which is what
nodes and the lab should run); it exists so that ``pip install`` alone yields a
working plugin.
"""

from cni_plugin.client import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
