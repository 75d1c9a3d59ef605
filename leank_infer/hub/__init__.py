"""The Hugging Face Hub: a revision downloaded to a folder, a folder uploaded in one commit; model cards and plots."""
