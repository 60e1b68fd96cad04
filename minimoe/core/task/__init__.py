"""The task: answer-choice batches, their scores and loss, and one training step."""
