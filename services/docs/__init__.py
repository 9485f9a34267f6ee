"""`hintserve docs generate`: the reference pages and figures of docs/ and README.md, made from the code and
the saved benchmark results so that they cannot drift from either."""
