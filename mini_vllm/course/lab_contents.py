"""``make lab``'s contents manager: the committed notebooks are read-only in its JupyterLab.

``make lab`` serves the repository root, so ``notebooks/``, ``exercises/`` and
``solutions/`` (the course as shipped, checked by ``make test``) appear beside
the learner's ``my-course/``. JupyterLab would autosave a committed notebook
the learner opened and ran there. ``CourseContentsManager`` is Jupyter's own
file manager, except that every path inside those folders:

* is reported as not writable, so JupyterLab shows its read-only badge, never
  autosaves it and answers Ctrl+S with "... is read-only. Use 'Save as...'";
* cannot be saved (new files, copies and uploads included), renamed, deleted
  or restored from a checkpoint: the request gets an HTTP 403 whose message
  points to the same path in ``my-course/`` (``lab.refuse_committed_path``).

Its cells still run: reading and executing a committed notebook is fine, only
writing it back is refused. vLLM has no counterpart: this is the course's tooling.
"""

from __future__ import annotations

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

from .lab import is_committed_path, refuse_committed_path


class CourseContentsManager(AsyncLargeFileManager):
    """Jupyter's default contents manager with ``notebooks/``, ``exercises/`` and ``solutions/`` read-only."""

    def is_writable(self, path: str) -> bool:
        return not is_committed_path(path) and super().is_writable(path)

    async def save(self, model, path=""):
        refuse_committed_path(path)  # also in lab.pre_save_hook; here it holds whatever hook is configured
        return await super().save(model, path)

    async def delete_file(self, path):
        refuse_committed_path(path, "delete")
        return await super().delete_file(path)

    async def rename_file(self, old_path, new_path):
        refuse_committed_path(old_path, "move")
        refuse_committed_path(new_path, "move a file into")
        return await super().rename_file(old_path, new_path)

    async def _copy_dir(self, from_path, to_path_original, to_name, to_path):  # a folder is copied without save()
        refuse_committed_path(to_path, "copy a folder to")
        return await super()._copy_dir(from_path, to_path_original, to_name, to_path)

    async def restore_checkpoint(self, checkpoint_id, path):
        refuse_committed_path(path, "restore a checkpoint of")
        return await super().restore_checkpoint(checkpoint_id, path)
