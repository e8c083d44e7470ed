"""When the engine was computing, from a sessionserve server log's request lines (`sessionserve.requests`).

Usage: python engine_busy.py ours.log [prefill_s_per_token]

Each turn runs from its estimated prefill start (its first token less its uncached prompt tokens at
`prefill_s_per_token`, default 0.15 ms) to its end. Prints the share of the run some turn was being computed,
and the share of its seconds with under 0.05 s of computing while a turn had waited more than 0.5 s.
"""
import re,sys,datetime
rows=[]
for line in open(sys.argv[1]):
    m=re.match(r'(\S+ \S+),(\d+) INFO sessionserve.requests .*session=(\S+) prompt_tokens=(\d+) cached_tokens=(\d+) output_tokens=(\d+) .*ttft_s=([\d.]+) e2e_s=([\d.]+)',line)
    if not m: continue
    t=datetime.datetime.strptime(m[1],'%Y-%m-%d %H:%M:%S').timestamp()+int(m[2])/1000
    sid,p,c,o,ttft,e2e=m[3],int(m[4]),int(m[5]),int(m[6]),float(m[7]),float(m[8])
    if sid=='None': continue
    rows.append((t-e2e,t-e2e+ttft,t,sid,p,c,o))
spt=float(sys.argv[2]) if len(sys.argv)>2 else 0.00015
t0=min(r[0] for r in rows); t1=max(r[2] for r in rows)
n=int(t1-t0)+1
busy=[0.0]*n; waiting=[0]*n
def add(arr,a,b,val=None):
    a-=t0;b-=t0
    i=int(a)
    while i<n and i<b:
        lo=max(a,i);hi=min(b,i+1)
        if hi>lo:
            if val is None: arr[i]+=hi-lo
            else: arr[i]=max(arr[i],1)
        i+=1
for s,f,e,sid,p,c,o in rows:
    start=max(s,f-(p-c)*spt)
    add(busy,start,e)
    if start-s>0.5: add(waiting,s,start,1)
# union busy
iv=sorted((max(s,f-(p-c)*spt),e) for s,f,e,sid,p,c,o in rows)
tot=0;cur=None
for a,b in iv:
    if cur is None or a>cur[1]:
        if cur: tot+=cur[1]-cur[0]
        cur=[a,b]
    else: cur[1]=max(cur[1],b)
tot+=cur[1]-cur[0]
idle_wait=sum(1 for i in range(n) if busy[i]<0.05 and waiting[i])
print(f"span {t1-t0:.0f}s computing {tot/(t1-t0):.0%}; seconds idle while a turn waited {idle_wait/n:.0%}; requests {len(rows)}")
