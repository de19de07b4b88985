"""`python -m zeroshard.demo`: the same as `zeroshard demo`."""

from zeroshard.demo.cli import main

raise SystemExit(main())
