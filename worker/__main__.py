import sys

from mlxcel_pool.cli import main

sys.exit(main(["worker", *sys.argv[1:]]))
