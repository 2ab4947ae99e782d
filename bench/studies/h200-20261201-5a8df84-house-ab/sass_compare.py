"""Compares the SASS of two builds' row and QK kernels, function by function (the names before
the house redesign mapped to the names after it), ignoring constant-bank offsets (the parameter
structs were reordered). Needs cuobjdump and nvdisasm (the PyPI wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm carry them).

    python3 sass_compare.py cuobjdump OLD.o[,OLD2.o] NEW.o[,NEW2.o] [rows] ["(key)" for a diff]
"""
import re, subprocess, sys, collections

CUOBJDUMP = sys.argv[1]
old_objs, new_objs = sys.argv[2].split(','), sys.argv[3].split(',')

def functions(objs):
    out = {}
    for obj in objs:
        text = subprocess.run([CUOBJDUMP, '-sass', obj], capture_output=True, text=True).stdout
        for chunk in text.split('Function : ')[1:]:
            name, body = chunk.split('\n', 1)
            ins = []
            for line in body.split('\n'):
                m = re.match(r'\s*/\*[0-9a-f]{4}\*/\s+(.*?);', line)
                if not m:
                    continue
                i = re.sub(r'c\[0x0\]\[0x[0-9a-f]+\]', 'c[0x0][P]', m.group(1))
                i = re.sub(r'0x[0-9a-f]+', lambda x: x.group(0), i)
                ins.append(i.strip())
            out[name.strip()] = ins
    return out

EPI = {'0': (0, 0, 0), '1': (0, 1, 0), '2': (1, 1, 0)}
def key(name):
    m = re.search(r'(oneshot|twoshot)_kernelI(.*?)Li(\d)ELNS0_8EpilogueE(\d)ELi(\d)EEEvNS0_13OneShotParams', name)
    if m:
        return (m.group(1), m.group(2), m.group(3), EPI[m.group(4)], m.group(5))
    m = re.search(r'(oneshot|twoshot)_kernelI(.*?)Li(\d)ENS0_11RowEpilogueILb(\d)ELb(\d)ELNS_10NormWeightE(\d)EEELi(\d)EEEvNS0_7RowCall', name)
    if m:
        return (m.group(1), m.group(2), m.group(3), tuple(int(x) for x in m.group(4, 5, 6)), m.group(7))
    m = re.search(r'local_epilogue_kernelI(.*?)LNS0_8EpilogueE(\d)ELi(\d)EEEvNS0_13OneShotParams', name)
    if m:
        return ('local', m.group(1), '-', EPI[m.group(2)], m.group(3))
    m = re.search(r'local_epilogue_kernelI(.*?)NS0_11RowEpilogueILb(\d)ELb(\d)ELNS_10NormWeightE(\d)EEELi(\d)EEEvNS0_7RowCall', name)
    if m:
        return ('local', m.group(1), '-', tuple(int(x) for x in m.group(2, 3, 4)), m.group(5))
    m = re.search(r'qk_rmsnorm_kernelI(.*?)EEEvNS0_(12QkNormParams|6QkCall)', name)
    if m:
        return ('qk', m.group(1))
    return None

old = {key(n): v for n, v in functions(old_objs).items() if key(n)}
new = {key(n): v for n, v in functions(new_objs).items() if key(n)}
same, diff, missing = [], [], []
for k, ins in old.items():
    if k not in new:
        missing.append(k)
    elif new[k] == ins:
        same.append(k)
    else:
        diff.append(k)
print(f'old kernels {len(old)}, new kernels {len(new)} (new only: {len(set(new) - set(old))})')
print(f'identical SASS (constant offsets aside): {len(same)}; different: {len(diff)}; missing in new: {len(missing)}')
by_kind = collections.Counter(k[0] for k in diff)
print('different by kernel:', dict(by_kind))
for k in sorted(diff, key=str)[:int(sys.argv[4]) if len(sys.argv) > 4 else 12]:
    a, b = old[k], new[k]
    print('  ', k, f'{len(a)} -> {len(b)} instructions')

if len(sys.argv) > 5:
    import difflib
    target = eval(sys.argv[5])
    a, b = old[target], new[target]
    for line in difflib.unified_diff(a, b, lineterm='', n=1):
        print(line)
