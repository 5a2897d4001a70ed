"""`python -m olmo_ctl` runs the `olmo-ctl` command line."""

from olmo_ctl.cli import entry

if __name__ == "__main__":
    entry()
