#!/usr/bin/env python3
"""Refits the attention watts of the kept profiles in models/gpu/history/ by head dim.

Each kept profile is refitted by today's `ctxplan calibrate` (./build/sim/ctxplan) from the samples
of the commit before the one that added it (history/README.md's rule), and its attention watts
split into head dim 128's and 64's in the proportion that refit finds, the profile's own mean of
the two kept (the power group's median served both before 2026-11-29). Prints each profile;
`apply` writes them. Run from the repository root; running it again changes nothing.
usage: scripts/refit-history-watts.py [apply]
"""
import glob
import os
import re
import subprocess
import sys
import tempfile

KEYS = ('attention_fwd_w', 'attention_bwd_w', 'attention_fwd_w_d64', 'attention_bwd_w_d64')


def sh(command):
    return subprocess.run(command, shell=True, capture_output=True, text=True, check=False).stdout


def watts(text):
    found = {}
    for key in KEYS:
        m = re.search(r'^  %s: ([0-9.e+-]+)$' % key, text, re.M)
        if m:
            found[key] = float(m.group(1))
    return found


def mean(w, direction):
    """The profile's one value of a direction: the mean of the two head dims where split."""
    d128 = w['attention_%s_w' % direction]
    return (d128 + w['attention_%s_w_d64' % direction]) / 2 if 'attention_%s_w_d64' % direction in w else d128


def main():
    apply = len(sys.argv) > 1 and sys.argv[1] == 'apply'
    tmp = tempfile.mkdtemp()
    for path in sorted(glob.glob('models/gpu/history/*.yaml')):
        text = open(path).read()
        name = re.search(r'^name: (\S+)', text, re.M).group(1)
        added = sh(f'git log --diff-filter=A --format=%H -- {path}').split()[-1]
        samples, refit = f'{tmp}/samples.csv', f'{tmp}/refit.yaml'
        sh(f'git show {added}^:models/gpu/calibration/{name}-samples.csv > {samples}')
        sh(f'./build/sim/ctxplan calibrate --samples {samples} --gpu {name} -o {refit}')
        new = watts(open(refit).read()) if os.path.exists(refit) else {}
        if os.path.exists(refit):
            os.remove(refit)
        if not all(k in new for k in KEYS):
            print(f'{os.path.basename(path)}: its samples time one head dim; left as it is')
            continue
        old = watts(text)
        values = {}
        for direction in ('fwd', 'bwd'):
            scale = mean(old, direction) / mean(new, direction)
            values['attention_%s_w' % direction] = new['attention_%s_w' % direction] * scale
            values['attention_%s_w_d64' % direction] = new['attention_%s_w_d64' % direction] * scale
        print(f'{os.path.basename(path):34s} from {added[:8]}: ' +
              ', '.join(f'{k} {v:.1f}' for k, v in values.items()))
        if not apply:
            continue
        text = re.sub(r'^  attention_(fwd|bwd)_w_d64: .*\n', '', text, flags=re.M)
        for direction in ('fwd', 'bwd'):
            key = 'attention_%s_w' % direction
            text = re.sub(r'^  %s: .*$' % key, '  %s: %g' % (key, values[key]), text, flags=re.M)
        text = re.sub(r'^(  attention_bwd_w: .*)$',
                      r'\1\n  attention_fwd_w_d64: %g\n  attention_bwd_w_d64: %g' %
                      (values['attention_fwd_w_d64'], values['attention_bwd_w_d64']), text, flags=re.M)
        open(path, 'w').write(text)


if __name__ == '__main__':
    main()
