"""The iterative-sequence arm: Triton's sequence batcher (`iterative_sequence: true`) decides who is in each
execute, and execute() runs one engine step over exactly those requests, rescheduling the unfinished ones."""
