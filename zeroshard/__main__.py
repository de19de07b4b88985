"""`python -m zeroshard ...` runs the `zeroshard` command."""

from zeroshard.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
