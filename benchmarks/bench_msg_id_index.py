"""Cost of the msg_id index on enqueue (the producer's spill path): same store, index dropped or kept."""
import os, sqlite3, statistics, sys, tempfile, time, uuid
sys.path.insert(0, "/work/wt-console")
from outbox.records import NewMessage
from outbox.stores import SQLiteOutbox

N, B, REPS = 100_000, 1000, 5
rows = [NewMessage("orders", b"x" * 200, key=b"k-%d" % i, msg_id=uuid.uuid4().hex) for i in range(N)]
tmp = tempfile.mkdtemp()
res = {"with": [], "without": []}
for rep in range(REPS):
    for mode in ("with", "without"):
        p = os.path.join(tmp, f"{mode}-{rep}.db")
        s = SQLiteOutbox(p)
        if mode == "without":
            c = sqlite3.connect(p); c.execute("DROP INDEX outbox_msg_id"); c.commit(); c.close()
        t = time.perf_counter(); c0 = time.process_time()
        for i in range(0, N, B):
            s.enqueue(rows[i:i + B])
        res[mode].append(((time.perf_counter() - t) / N * 1e6, (time.process_time() - c0) / N * 1e6))
        s.close()
for m, v in res.items():
    print(m, "wall µs/msg", round(statistics.median(x[0] for x in v), 2), "cpu µs/msg", round(statistics.median(x[1] for x in v), 2))
print("ratio wall", round(statistics.median(a[0] / b[0] for a, b in zip(res["with"], res["without"])), 3),
      "cpu", round(statistics.median(a[1] / b[1] for a, b in zip(res["with"], res["without"])), 3))
