"""`python -m hybridlm.cli`: the `hybridlm` command."""

from hybridlm.cli import main

if __name__ == "__main__":  # (imported, as the layout test imports every module, it does nothing)
    main()
