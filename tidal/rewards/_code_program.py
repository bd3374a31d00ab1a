"""The program's side of a code grading (S, tidal/rewards/_code_grader.py): a server that
imports the program and answers G's requests about its objects.

S keeps every object G holds a handle to (so that a handle stays valid), returns plain
values by copy and everything else by reference, and calls G's functions back through the
same conversation. It reports ready before it imports anything of the program.
"""
# ruff: noqa: BLE001 — answering whatever the program raises is this file's job.

import sys

if __name__ != "__main__":  # imported on the host; in the sandbox the parts run as one script
    from tidal.rewards._code_wire import Peer, decode, encode, receive, send


class Server(Peer):
    def __init__(self, read_fd, write_fd):
        super().__init__(read_fd, write_fd)
        self.objects = {}  # hid -> object kept alive for G's handles
        self.hids = {}  # id(object) -> hid

    def ref(self, obj):
        key = id(obj)
        if key not in self.hids:
            hid = len(self.objects)
            self.objects[hid] = obj
            self.hids[key] = hid
        return ["h", self.hids[key]]

    def encode(self, value):
        return encode(value, self.ref, plain_only_exact=False)

    def decode(self, node):
        def handle(tag, n):
            if tag == "h":
                return self.objects[n[1]]
            return self.callback_stub(n[1])

        return decode(node, handle)

    def callback_stub(self, gid):
        def call_the_tests(*args, **kwargs):
            reply = self.request(["callback", gid, [self.encode(a) for a in args],
                                  {str(k): self.encode(v) for k, v in kwargs.items()}])
            if reply[0] == "ok":
                return self.decode(reply[1])
            raise RuntimeError(f"a function of the tests raised {reply[2]}: {reply[3]}")

        return call_the_tests

    def serve(self, message):
        try:
            return self.answer(message)
        except StopIteration:
            return ["stop"] if message[0] == "next" else self.raised(StopIteration("raised by the program"))
        except Exception as e:
            return self.raised(e)

    @staticmethod
    def raised(e):
        return ["raise", str(type(e).__module__), str(type(e).__name__), str(e)[:2000]]

    def answer(self, message):
        op = message[0]
        if op == "ping":
            return ["ok", self.encode("pong")]
        if op == "import":
            __import__(message[1])  # importlib's own import costs a grading 10 ms
            module = sys.modules[message[1]]
            names = {name: value for name, value in vars(module).items() if not name.startswith("__")}
            return ["ok", ["d", [[self.encode(k), self.encode(v)] for k, v in names.items()]]]
        if op == "call":
            args = [self.decode(a) for a in message[2]]
            kwargs = {k: self.decode(v) for k, v in message[3].items()}
            result = self.objects[message[1]](*args, **kwargs)
            mutable = (list, dict, set)
            back = [[i, self.encode(a)] for i, a in enumerate(args) if type(a) in mutable]
            back += [[k, self.encode(v)] for k, v in kwargs.items() if type(v) in mutable]
            return ["ok", self.encode(result), back]
        if op == "isinstance":
            return ["ok", self.encode(isinstance(self.decode(message[2]), self.objects[message[1]]))]
        obj = self.objects[message[1]]
        if op == "getattr":
            return ["ok", self.encode(getattr(obj, message[2]))]
        if op == "setattr":
            setattr(obj, message[2], self.decode(message[3]))
            return ["ok", ["n"]]
        if op == "getitem":
            return ["ok", self.encode(obj[self.decode(message[2])])]
        if op == "setitem":
            obj[self.decode(message[2])] = self.decode(message[3])
            return ["ok", ["n"]]
        if op == "compare":
            import operator

            compare = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
                       "gt": operator.gt, "ge": operator.ge}[message[2]]
            return ["ok", self.encode(compare(obj, self.objects[message[3]]))]
        simple = {"len": len, "bool": bool, "iter": iter, "next": next, "int": int, "index": lambda o: o.__index__(),
                  "float": float, "repr": repr, "str": str}
        if op in simple:
            return ["ok", self.encode(simple[op](obj))]
        raise ValueError(f"unknown request {op!r}")


def server_main(read_fd, write_fd, workspace):
    import operator  # noqa: F401 — before the workspace is on the path

    server = Server(read_fd, write_fd)
    send(write_fd, ["ready"])
    sys.path.insert(0, workspace)
    while True:
        message = receive(read_fd)
        if message is None:
            return
        send(write_fd, server.serve(message))
