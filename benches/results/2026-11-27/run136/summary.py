import re,statistics as st,sys
arm=None; d={}; ahead={}
last=None
for line in open(sys.argv[1]):
    m=re.match(r'## round (\d+) arm (\S+)',line)
    if m: arm=m.group(2); continue
    if line.startswith('pool:'):
        f=line.split(); init=f[0]; run=f[1]; ns=float(f[4])
        r=re.search(r'= ([0-9.]+) \((\d+) grows.*?(\d+) shard spills.*?([0-9.]+) ms growing',line)
        last=(run,init,arm)
        d.setdefault(last,[]).append([ns,float(r.group(1)),int(r.group(2)),int(r.group(3)),float(r.group(4)),0.0])
    m=re.match(r'grow-ahead: ([0-9.]+) ms',line)
    if m and last: d[last][-1][5]=float(m.group(1))
arms=sys.argv[2].split(',')
for run in ['churn-1t','churn-4t','churn-xs-1t','churn-xs-4t']:
  for init in ['pool:2048M','pool:256M']:
    out=[]
    for a in arms:
        v=d.get((run,init,a),[])
        if not v: continue
        ns=sorted(x[0] for x in v)
        out.append(f"{a}: {st.median(ns):6.1f} ({ns[0]:.1f}..{ns[-1]:.1f}) mem≤{max(x[1] for x in v):.3f} gr~{st.median([x[2] for x in v]):.0f} sp~{st.median([x[3] for x in v]):.0f} syncms~{st.median([x[4] for x in v]):.1f} aheadms~{st.median([x[5] for x in v]):.1f}")
    print(run,init); [print('   ',o) for o in out]
