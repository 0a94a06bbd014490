import re,sys,statistics as st,os
d=sys.argv[1]; names=sys.argv[2:]
L=re.compile(r"pool:(\d+)M\s+(\S+)\s+\d+\s+\S+\s+([\d.]+)\s.*= ([\d.]+) \((\d+) grows.*?(\d+) shard spills, (\d+) cache hits, ([\d.]+) ms growing")
for n in names:
    inv=[];cur={}
    for line in open(os.path.join(d,n+'.txt')):
        m=L.search(line)
        if not m: continue
        start,run,ns,mem,gr,sp,ch,gms=m.groups()
        cur[(run,start)]=(float(ns),float(mem),int(gr),int(sp),float(gms))
        if run=='churn-xs-4t' and start=='256': inv.append(cur); cur={}
    out=[]
    for run in ['churn-1t','churn-4t','churn-xs-1t','churn-xs-4t']:
        rs=[i[(run,'256')][0]/i[(run,'2048')][0] for i in inv if (run,'256') in i]
        sp=[i[(run,'256')][3] for i in inv]; gr=[i[(run,'256')][2] for i in inv]; gms=[i[(run,'256')][4] for i in inv]
        mem=max(i[(run,'256')][1] for i in inv)
        out.append(f"{run}: {st.median(rs):.2f} [{min(rs):.2f}..{max(rs):.2f}] >1.15:{sum(r>1.15 for r in rs)}/{len(rs)} mem {mem:.3f} grows {st.median(gr)} spills {st.median(sp)} grow {st.median(gms):.1f}ms")
    print(n); print("\n".join("   "+o for o in out))
