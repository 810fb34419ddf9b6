"""Merging what each process of a run committed (the exchange itself runs in
multiprocess_test, between real processes)."""

from absl.testing import absltest

from zkdv import errors
from zkdv.jax import processes


class MergeTest(absltest.TestCase):

  def test_each_piece_comes_from_the_process_that_holds_it(self):
    first = [[b"a" * 32, None], [b"c" * 32]]
    second = [[None, b"b" * 32], [b"x" * 32]]  # a replica's copy: the first holder wins
    self.assertEqual(processes.merge([first, second], "post-state"),
                     [[b"a" * 32, b"b" * 32], [b"c" * 32]])

  def test_a_piece_no_process_holds_is_named(self):
    with self.assertRaisesRegex(errors.CommitmentError,
                                r"no process committed part 1 of post-state leaf 0.*"
                                r"out_shardings"):
      processes.merge([[[b"a" * 32, None]], [[None, None]]], "post-state")

  def test_processes_must_agree_on_the_layout(self):
    with self.assertRaises(ValueError):
      processes.merge([[[b"a" * 32]], [[b"a" * 32], [b"b" * 32]]], "batch")

  def test_one_process_is_its_own_group(self):
    group = processes.ProcessGroup.current()
    self.assertFalse(group.multi)
    self.assertTrue(group.is_writer)
    self.assertEqual(group.open_run(lambda: {"seed": b"s"}), {"seed": b"s"})
    self.assertEqual(group.gather("0/state", [[b"d"]]), [[[b"d"]]])


if __name__ == "__main__":
  absltest.main()
