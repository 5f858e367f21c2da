"""The `stagemesh` command line."""
import sys
def main(argv=None) -> int:
    print("stagemesh: under construction", file=sys.stderr)
    return 1
